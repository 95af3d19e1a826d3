"""Access: the store and the dead letters behind a restricted ACL user, and TLS.

The ACL user of these tests has exactly the commands the README lists under
"Redis permissions", on the package's keys only. The core flow (a read, an
idempotent write, a non-idempotent write, a dead letter from a failing write
and one from an unknown task) and the operators' actions (list, page with
filters, stats, show, replay, purge, late outcome, audit tail and verify) run
with that user as the store and as the dead-letter store. The server is the
test's own, so ``MONITOR`` sees every command the package sends (scripts'
commands included): the test checks that the documented list is exactly what
is used, and that the ACL log holds no refusal besides the optional commands.

The broker is ``memory://`` here, because the dead letters are kept in the
broker's Redis whenever the broker is Redis; with a Redis broker the same
commands are needed on the broker's Redis (see the README).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.admin.operations import DeadLetterOperations
from celery_tooleffect.store.dead_letter_queries import DeadLetterQuery
from celery_tooleffect.store.journal import Journal, JournalRef
from tests.conftest import RedisServer, free_port, redis_server, running_worker, wait_for
from tests.support import Monitor
from tests.test_bad_messages import publish

#: The README's "Redis permissions" lists, by who needs them.
WORKER_COMMANDS = {
    "evalsha", "script|load", "ping",
    # inside the package's scripts (journal, audit, storing a dead letter)
    "hmget", "hget", "hset", "hsetnx", "hincrby", "expire", "zadd", "sadd",
    # a dead-lettered write's journal entry, kept as long as its letter
    "persist",
    # a run's audit events, a list (prelude.lua's append_event; trimming)
    "lindex", "rpush", "lset", "lrange", "ltrim",
    # the rollback watch inside the intent script (store/rollback.py)
    "get", "set",
    # outside them (global stream copy "xadd", journal reads, dead-letter lookups,
    # a late outcome copied onto a dead letter, the declared effects a worker
    # publishes, reads and withdraws: store/declarations.py)
    "xadd", "hgetall", "hdel", "watch", "multi", "exec",
}
#: What operators (CLI, Flower, AuditLog/DeadLetters readers) need besides the
#: workers' commands. ``xread`` (``tooleffect audit tail --follow``) is listed
#: in the README too but not run here.
OPERATOR_COMMANDS = {
    "zrem", "srem", "hlen", "smembers", "zcard", "zrevrange", "zrevrangebyscore",
    "zmscore", "xrevrange", "scan",
}
#: Asked for but not needed: a refusal is handled (and logged) by the package
#: (``config|get``, ``info``: the worker-start persistence, eviction and
#: replica checks; ``smembers``, ``zcard``, ``zrevrange``: the worker-start
#: warning about unresolved dead letters, left out when refused) or ignored by
#: redis-py (``client|setinfo``, sent on connect).
OPTIONAL_COMMANDS = {"config|get", "info", "client|setinfo", "smembers", "zcard", "zrevrange"}
PASSWORD = "p@ss:w/rd 🙂"


def acl_rules(key_prefix: str, operators: bool = True) -> list[str]:
    """The ``ACL SETUSER`` rules of the README, for keys under ``key_prefix``."""
    commands = sorted(WORKER_COMMANDS | (OPERATOR_COMMANDS | {"xread"} if operators else set()))
    return ["on", f">{PASSWORD}", "resetkeys", "resetchannels", f"~{key_prefix}*", "-@all",
            *(f"+{command}" for command in commands)]


def store_url(port: int, scheme: str = "redis", query: str = "") -> str:
    password = urllib.parse.quote(PASSWORD, safe="")
    return f"{scheme}://tooleffect:{password}@127.0.0.1:{port}/0{query}"


def define_tools(app: Celery, runs: list[str]) -> dict[str, Any]:
    @app.task(base=ToolTask, name="access.read", shared=False)
    def read(value: str) -> str:
        return value

    @app.task(base=ToolTask, name="access.set", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def set_value(value: str) -> str:
        return value

    @app.task(base=ToolTask, name="access.send", shared=False, bind=True,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send(self: Any, amount: int) -> int:
        runs.append(str(self.request.id))
        if amount < 0:
            raise ValueError("negative amount")
        return amount

    return {"read": read, "set": set_value, "send": send}


def core_flow(app: Celery, operators: bool = True) -> dict[str, str]:
    """The core flow and (with ``operators``) the operators' actions; returns the
    dead letters' task ids."""
    runs: list[str] = []
    tools = define_tools(app, runs)
    audit = AuditLog(app)
    letters = DeadLetters(app)
    operations = DeadLetterOperations(app)
    with running_worker(app):
        assert audit.client.ping()
        assert tools["read"].delay("r").get(timeout=20) == "r"
        assert tools["set"].delay("s").get(timeout=20) == "s"
        sent = tools["send"].delay(5)
        assert sent.get(timeout=20) == 5
        refused = tools["send"].delay(-1)
        unknown = uuid.uuid4().hex
        headers = dict(app.amqp.as_task_v2(unknown, "access.gone", args=[]).headers)
        publish(app, ([], {}, {"callbacks": None, "errbacks": None, "chain": None,
                               "chord": None}), headers, serializer="json")
        wait_for(lambda: letters.get(refused.id) and letters.get(unknown),
                 what="two dead letters")
        assert letters.record_late_outcome(refused.id, {"phase": "outcome", "status": "x"})
        if not operators:
            return {"refused": refused.id, "unknown": unknown}

        # What operators do (CLI, Flower): read, page, count, show, replay, purge.
        assert {letter.task_id for letter in letters.list()} == {refused.id, unknown}
        page = letters.page(DeadLetterQuery(reason="not_retryable", effect="non_idempotent_write"))
        assert [letter.task_id for letter in page.letters] == [refused.id]
        first = letters.page(limit=1)
        assert first.next_cursor is not None
        assert len(letters.page(limit=1, before=first.next_cursor).letters) == 1
        assert letters.stats().total == 2
        assert sum(count.count for count in letters.counts()) == 2  # Flower's gauges
        assert set(letters.oldest()) == {"tools"}
        assert operations.detail(refused.id) is not None
        assert not operations.replay(refused.id, actor="test", reason="r", force=True).ok
        purged = operations.purge(unknown, actor="test", reason="handled")
        assert purged.ok, purged.message
        journal = Journal(audit.settings, audit)
        assert journal.read(JournalRef(sent.id, sent.id))["state"] == "succeeded"
        assert [e["phase"] for e in audit.events(sent.id)] == ["intent", "outcome"]
        assert audit.tail(10)
        assert audit.verify(sent.id).intact
        assert sent.id in set(audit.runs())
    assert runs.count(sent.id) == 1 and runs.count(refused.id) == 1
    return {"refused": refused.id, "unknown": unknown}


@pytest.fixture
def acl_server(prefix: str) -> Iterator[RedisServer]:
    with redis_server() as server:
        server.client().execute_command("ACL", "SETUSER", "tooleffect",
                                        *acl_rules(f"{prefix}te:"))
        yield server


def test_a_restricted_acl_user_is_enough_for_the_store_and_the_dead_letters(
    make_app: Callable[..., Celery], acl_server: RedisServer, prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    admin = acl_server.client()
    app = make_app(broker_url="memory://", tooleffect_redis_url=store_url(acl_server.port),
                   tooleffect_run_stream_maxlen=1)  # a dead letter's run is trimmed
    caplog.set_level(logging.WARNING, logger="celery_tooleffect.worker.startup")
    with Monitor(acl_server.client()) as monitor:
        core_flow(app)

    documented = WORKER_COMMANDS | OPERATOR_COMMANDS
    # HELLO (the handshake that authenticates) is always allowed.
    used = monitor.acl_names() - (OPTIONAL_COMMANDS - OPERATOR_COMMANDS) - {"hello"}
    assert used == documented, (
        f"undocumented: {sorted(used - documented)}; "
        f"documented but unused: {sorted(documented - used)}"
    )
    refusals = admin.acl_log()
    assert {entry["object"] for entry in refusals} <= OPTIONAL_COMMANDS, refusals
    assert {entry["reason"] for entry in refusals} <= {"command"}, refusals
    assert "could not check whether" in caplog.text  # CONFIG GET refused: said so, went on
    # Nothing outside the package's prefix was written.
    assert {key.decode() for key in admin.scan_iter(count=1000)} <= {
        key.decode() for key in admin.scan_iter(match=f"{prefix}te:*", count=1000)
    }


def test_workers_need_only_the_workers_commands(
    make_app: Callable[..., Celery], prefix: str,
) -> None:
    with redis_server() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "tooleffect",
                              *acl_rules(f"{prefix}te:", operators=False))
        app = make_app(broker_url="memory://", tooleffect_redis_url=store_url(server.port),
                       tooleffect_run_stream_maxlen=1)
        with Monitor(server.client()) as monitor:
            core_flow(app, operators=False)
        # Every worker command is sent: HGETALL and HDEL by the declared effects
        # (published at start, withdrawn at stop) whether or not a dead letter
        # begun by a stopped worker is finished (HGETALL too).
        assert monitor.acl_names() - OPTIONAL_COMMANDS - {"hello"} == WORKER_COMMANDS
        assert {entry["object"] for entry in admin.acl_log()} <= OPTIONAL_COMMANDS


def test_a_user_without_a_needed_command_is_refused_loudly(
    make_app: Callable[..., Celery], acl_server: RedisServer, prefix: str,
) -> None:
    """Without HSETNX no dead letter can be stored: the refusal is an error the
    package reports (StoreUnavailable), never a silent success."""
    from celery_tooleffect.errors import StoreUnavailable
    from celery_tooleffect.store.dead_letter_record import DeadLetter

    acl_server.client().execute_command("ACL", "SETUSER", "tooleffect", "-hsetnx")
    app = make_app(broker_url="memory://", tooleffect_redis_url=store_url(acl_server.port),
                   tooleffect_run_stream_maxlen=1)  # a dead letter's run is trimmed
    letter = DeadLetter(task_id="t", name="n", queue="tools", reason="not_retryable",
                        failure_class="unknown", effect="read_only")
    with pytest.raises(StoreUnavailable, match=r"can't run this command"):
        DeadLetters(app).store(letter)


# -- TLS ----------------------------------------------------------------------------


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA), and its key."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is available")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
             "-addext", "basicConstraints=critical,CA:TRUE"],
            check=True, capture_output=True, timeout=60,
        )
        return cert, key
    import datetime
    import ipaddress

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(private.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return cert, key


def test_rediss_with_an_acl_user_for_the_store_and_the_dead_letters(
    make_app: Callable[..., Celery], prefix: str, tmp_path: Path,
) -> None:
    cert, key = make_certificate(tmp_path)
    tls_port = free_port()
    try:
        context = redis_server("--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                               "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                               "--tls-auth-clients", "no")
        server = context.__enter__()
    except AssertionError as exc:  # it never answered on its plain port
        pytest.skip(f"this redis-server does not start with --tls-port (built without "
                    f"TLS?): {exc}")
    try:
        server.client().execute_command("ACL", "SETUSER", "tooleffect",
                                        *acl_rules(f"{prefix}te:"))
        url = store_url(tls_port, "rediss",
                        f"?ssl_cert_reqs=required&ssl_ca_certs={urllib.parse.quote(str(cert))}")
        app = make_app(broker_url="memory://", tooleffect_redis_url=url)
        assert AuditLog(app).client.connection_pool.connection_class.__name__ == "SSLConnection"
        dead = core_flow(app)
        assert DeadLetters(app).get(dead["refused"]) is not None
        # The plain port (kept open for the test's admin) shows what was stored.
        plain = redis.Redis(port=server.port, username="tooleffect", password=PASSWORD)
        assert plain.hget(f"{prefix}te:{{dlq:tools}}:envelopes", dead["refused"])
        # A client that does not trust the certificate is refused.
        untrusting = make_app(broker_url="memory://",
                              tooleffect_redis_url=store_url(tls_port, "rediss",
                                                             "?ssl_cert_reqs=required"))
        assert AuditLog(untrusting).record_step(
            {"run_id": "r", "task_id": "t", "phase": "note", "status": "x"}) is False
    finally:
        context.__exit__(None, None, None)
