"""Every Redis form kombu accepts as a broker, with the store following it.

Each form gets redis-servers of its own (TCP with an ACL user, a unix socket,
a failover list of two servers, TLS with client certificates, three Sentinels
in front of a primary and a replica). A real worker on that broker, with
``tooleffect_redis_url`` unset, runs a NON_IDEMPOTENT_WRITE, an
IDEMPOTENT_WRITE and a READ_ONLY tool, and a write whose deadline outlasts
the visibility timeout; then the write is delivered again under
the same task id. Asserted: every call succeeds, each body ran once (counted
in files, not in Redis), the journal and audit trail are on the broker's own
server, and no other server (the failover list's second one, the machine's
Redis) holds a key of the test's prefix.

Malformed and unsupported forms are refused with a ConfigurationError naming
the setting, in process (no I/O is needed to refuse them).
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect.errors import ConfigurationError
from celery_tooleffect.settings import settings_for
from celery_tooleffect.store.keys import Keys
from celery_tooleffect.testing import free_port, redis_server
from tests.conftest import REDIS_URL, TESTS, app_config, start_celery_worker, wait_for
from tests.support import run_fields
from tests.topologies import MASTER, certificates, sentinel_set


@dataclass
class Form:
    """A broker URL form and the servers it is made of."""

    name: str
    broker: str
    backend: str
    #: A client of the server that must hold the store's keys.
    store: redis.Redis
    #: Clients of servers that must hold none of the test's keys.
    elsewhere: list[redis.Redis] = field(default_factory=list)
    transport: dict[str, Any] = field(default_factory=dict)
    backend_transport: dict[str, Any] = field(default_factory=dict)
    ssl: dict[str, Any] = field(default_factory=dict)


FORMS = ["acl-user-db", "unix-socket", "failover-list", "tls-client-cert", "sentinel"]


@pytest.fixture(params=FORMS)
def form(request: pytest.FixtureRequest) -> Iterator[Form]:
    name = request.param
    machine = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    with ExitStack() as stack:
        if name == "acl-user-db":
            server = stack.enter_context(redis_server(
                "--user", "tool", "on", ">s3cret", "~*", "&*", "+@all"))
            url = f"redis://tool:s3cret@127.0.0.1:{server.port}/3"
            store = server.client(db=3, username="tool", password="s3cret")
            yield Form(name, url, url, store, [machine, server.client(db=0)])
        elif name == "unix-socket":
            # A short path: a unix socket's path is limited to about 100 bytes.
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="te-")))
            socket = folder / "redis.sock"
            server = stack.enter_context(redis_server(
                "--unixsocket", str(socket), "--unixsocketperm", "700"))
            yield Form(name, f"redis+socket://{socket}?virtual_host=2",
                       f"redis://127.0.0.1:{server.port}/2", server.client(db=2),
                       [machine, server.client(db=0)])
        elif name == "failover-list":
            first = stack.enter_context(redis_server())
            second = stack.enter_context(redis_server())
            url = f"redis://127.0.0.1:{first.port}/1;redis://127.0.0.1:{second.port}/1"
            yield Form(name, url, f"redis://127.0.0.1:{first.port}/1", first.client(db=1),
                       [machine, second.client(db=1)],
                       transport={"failover_strategy": "round-robin"})
        elif name == "tls-client-cert":
            certs = stack.enter_context(certificates())
            cert, key = certs.pair("server")
            tls_port = free_port()
            server = stack.enter_context(redis_server(
                "--tls-port", str(tls_port), "--tls-cert-file", cert, "--tls-key-file", key,
                "--tls-ca-cert-file", certs.ca, "--tls-auth-clients", "yes"))
            client_cert, client_key = certs.pair("client")
            ssl = {"ssl_cert_reqs": "required", "ssl_ca_certs": certs.ca,
                   "ssl_certfile": client_cert, "ssl_keyfile": client_key}
            url = f"rediss://127.0.0.1:{tls_port}/0"
            yield Form(name, url, url, server.client(), [machine], ssl=ssl)
        else:
            group = stack.enter_context(sentinel_set(
                replicas=1, password="m4ster", sentinel_password="s3ntinel"))
            sentinel = {"master_name": MASTER, "sentinel_kwargs": {"password": "s3ntinel"}}
            yield Form(name, group.urls, group.urls, group.client(group.master()),
                       [machine], transport=sentinel, backend_transport=sentinel)


def test_a_worker_on_each_form_journals_on_the_brokers_server(
        form: Form, tmp_path: Path, prefix: str) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    env = {"TE_PREFIX": prefix, "TE_BROKER": form.broker, "TE_BACKEND": form.backend,
           "TE_TRANSPORT": json.dumps(form.transport), "TE_SSL": json.dumps(form.ssl),
           "TE_BACKEND_TRANSPORT": json.dumps(form.backend_transport), "TE_RUNS": str(runs),
           "TE_VT": "3"}
    producer = Celery("prod-producer", set_as_current=False)
    producer.conf.update(app_config(
        prefix, broker_url=form.broker, result_backend=form.backend,
        broker_transport_options={"global_keyprefix": prefix, **form.transport},
        result_backend_transport_options={"global_keyprefix": prefix,
                                          **form.backend_transport},
        broker_use_ssl=form.ssl or None, redis_backend_use_ssl=form.ssl or None))
    worker = start_celery_worker("tests.apps.prod_app", tmp_path / "worker.log", env=env,
                                 root=TESTS.parent)
    try:
        task_id = f"write-{uuid.uuid4().hex[:8]}"
        write = producer.send_task("prod.write", ("w",), task_id=task_id)
        assert write.get(timeout=30) == "wrote w", worker.output()
        assert producer.send_task("prod.idem", ("i",)).get(timeout=30) == "set i"
        assert producer.send_task("prod.read", ("r",)).get(timeout=30) == "read r"
        # Longer than the visibility timeout (3 s): its broker lease, on the
        # broker's server whatever the form, keeps the message from coming back.
        deadline = producer.send_task("prod.write_deadline", ("d", 5.0))
        assert deadline.get(timeout=30) == "wrote d"
        assert worker.output().count(f"[{deadline.id}] received") == 1

        # Delivered again under the same id: the journal, on the broker's
        # server, acknowledges it without running.
        producer.send_task("prod.write", ("w",), task_id=task_id)
        events = Keys(f"{prefix}te:").run_events(task_id)
        wait_for(lambda: b"duplicate_ignored" in _phases(form.store, events),
                 timeout=30, what="the second delivery to be acknowledged without running")
        assert [(runs / key).read_text().count("\n") for key in ("w", "i", "r", "d")] == [1] * 4
        assert _phases(form.store, events)[:2] == [b"intent", b"outcome"]
        for other in form.elsewhere:
            assert not list(other.scan_iter(match=f"{prefix}*", count=1000)), (
                f"{form.name}: keys of the test on another server than the broker's")
        assert "Traceback" not in worker.output()
    finally:
        worker.stop()
        for client in (form.store, *form.elsewhere):
            for key in client.scan_iter(match=f"{prefix}*", count=1000):
                client.delete(key)


def _phases(client: redis.Redis, stream: str) -> list[bytes]:
    return [fields[b"phase"] for fields in run_fields(client, stream)]


# -- refused at start, in process ------------------------------------------------------


@pytest.mark.parametrize(("conf", "message"), [
    ({"broker_url": "redis://127.0.0.1:notaport/0"}, "broker_url: redis://127.0.0.1:notaport"),
    # Refused while the settings are read: nothing connects to these ports.
    ({"broker_url": "sentinel://127.0.0.1:26390;sentinel://127.0.0.1:26391"},
     "needs the transport option master_name"),
    ({"broker_url": "sentinel://127.0.0.1:26390;redis://127.0.0.1:6390"},
     "is not a Redis URL the package can use"),
    ({"broker_url": "memory://", "tooleffect_redis_url": "http://127.0.0.1:6390"},
     "tooleffect_redis_url: http://127.0.0.1:6390 is not a Redis URL"),
    ({"tooleffect_redis_url": "rediss://:pw@127.0.0.1:6380/0?ssl_bogus=1"},
     "unknown TLS option(s) ssl_bogus"),
    ({"tooleffect_redis_url": "redis://u:hunter2@127.0.0.1:x/0"}, "redis://u:***@"),
    ({"tooleffect_store_replicas": -1}, "tooleffect_store_replicas must be"),
    ({"tooleffect_store_replicas": 1, "tooleffect_store_wait_timeout": 9},
     "must be above 0 and below tooleffect_socket_timeout"),
])
def test_a_form_the_package_cannot_use_is_refused_naming_the_setting(
        conf: dict[str, Any], message: str, prefix: str) -> None:
    app = Celery("refused", set_as_current=False)
    app.conf.update(app_config(prefix, **conf))
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app)
    assert message in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_the_store_follows_a_sentinel_broker_and_never_the_default_server(prefix: str) -> None:
    app = Celery("sentinel-store", set_as_current=False)
    app.conf.update(app_config(
        prefix, broker_url="sentinel://:pw@127.0.0.2:26379/4;sentinel://127.0.0.3:26380/4",
        broker_transport_options={"master_name": "prod", "sentinel_kwargs": {"password": "s"}}))
    settings = settings_for(app)
    assert settings.broker_is_redis
    assert settings.store == settings.broker_redis == settings.dead_letter_store
    store = settings.store_endpoint
    assert store.behind_sentinel and store.master_name == "prod" and store.db == 4
    assert store.sentinels == (("127.0.0.2", 26379), ("127.0.0.3", 26380))
    # Behind Sentinel a write's intent waits for one replica by default.
    assert settings.store_replicas == 1


def test_a_sentinel_result_backend_on_the_stores_master_is_written_by_the_outcome(
        prefix: str) -> None:
    """Behind Sentinel too, broker, backend and store on one master: the
    write's Celery result rides in its outcome script (one-Redis path)."""
    from celery_tooleffect.store.runtime import runtime_for
    from celery_tooleffect.worker.results import backend_is_the_store

    urls = "sentinel://:pw@127.0.0.2:26379/1;sentinel://127.0.0.3:26380/1"
    sentinel = {"master_name": "prod"}
    app = Celery("sentinel-results", set_as_current=False)
    app.conf.update(app_config(prefix, broker_url=urls, result_backend=urls,
                               broker_transport_options=sentinel,
                               result_backend_transport_options=sentinel))
    assert backend_is_the_store(app.backend, runtime_for(app))
    other = Celery("sentinel-results-other", set_as_current=False)
    other.conf.update(app_config(prefix, broker_url=urls, result_backend=urls,
                                 broker_transport_options=sentinel,
                                 result_backend_transport_options={"master_name": "other"}))
    assert not backend_is_the_store(other.backend, runtime_for(other))
