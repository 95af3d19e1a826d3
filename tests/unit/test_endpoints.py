"""URL forms (celery_tooleffect/endpoints.py): every form kombu and Celery
accept for a Redis, resolved to one endpoint without I/O; what cannot be
resolved is refused naming the setting, with no password shown."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.endpoints import (
    DIRECT_SCHEMES,
    REDIS_FAMILY,
    RedisEndpoint,
    is_redis_family,
    masked_url,
    resolve,
    scheme_of,
    server_identity,
)
from celery_tooleffect.errors import ConfigurationError

PROPERTIES = settings(max_examples=150, deadline=None, database=None)


@pytest.mark.parametrize(("url", "options"), [
    ("redis://cache.example:6379/0", {"host": "cache.example", "port": 6379, "db": 0}),
    ("redis://u:p%40ss@h:1234/5",
     {"host": "h", "port": 1234, "db": 5, "username": "u", "password": "p@ss"}),
    ("rediss://h:6380/1?ssl_cert_reqs=required",
     {"host": "h", "port": 6380, "db": 1, "ssl": True, "ssl_cert_reqs": "required"}),
    # kombu's socket form reads the database from virtual_host, Celery's from db.
    ("redis+socket:///tmp/r.sock?virtual_host=3", {"path": "/tmp/r.sock", "db": 3}),
    ("socket:///tmp/r.sock?db=2", {"path": "/tmp/r.sock", "db": 2}),
    ("unix:///tmp/r.sock?db=4", {"path": "/tmp/r.sock", "db": 4}),
    ("redis+socket://u:pw@/tmp/r.sock", {"path": "/tmp/r.sock", "db": 0, "username": "u",
                                         "password": "pw"}),
    # A failover list: the package's records stay on its first server.
    ("redis://a:1/0;redis://b:2/0", {"host": "a", "port": 1, "db": 0}),
    (" redis://a:1/3 ; redis://b:2/0 ", {"host": "a", "port": 1, "db": 3}),
])
def test_every_direct_form_resolves_to_its_server(url: str, options: dict[str, object]) -> None:
    endpoint = resolve(url, setting="broker_url")
    assert endpoint.options == options
    assert not endpoint.behind_sentinel and not endpoint.cluster
    assert endpoint.db == options.get("db", 0)
    assert endpoint.tls is bool(options.get("ssl"))


def test_what_a_url_leaves_out_is_redis_s_default_in_its_identity() -> None:
    bare = resolve("redis://h", setting="s")
    full = resolve("redis://h:6379/0", setting="s")
    # kombu reads redis://h// (virtual host '/') as database 0.
    slash = resolve("redis://h//", setting="s")
    assert bare.identity() == full.identity() == slash.identity() == ("h", 6379, 0, "default", "")
    assert bare.describe() == full.describe() == "redis://h:6379/0"


def test_identity_tells_servers_databases_and_users_apart() -> None:
    identities = {
        resolve(url, setting="s").identity()
        for url in ("redis://h:1/0", "redis://h:2/0", "redis://h:1/1", "redis://u:p@h:1/0",
                    "redis://g:1/0", "unix:///h?db=0")
    }
    assert len(identities) == 6
    # The same server however it is written (a failover list keeps its first).
    assert resolve("redis://h:1/0;redis://x:9/0", setting="s").identity() == resolve(
        "redis://h:1", setting="s").identity()
    assert server_identity({"path": "/s", "port": 99}) == ("/s", 0, 0, "default", "")


def test_a_url_s_tls_options_are_completed_by_the_setting_s_never_overridden() -> None:
    endpoint = resolve("rediss://h:1/0?ssl_cert_reqs=required", setting="s",
                       ssl={"ssl_cert_reqs": "none", "ssl_ca_certs": "/ca.pem"})
    assert endpoint.options["ssl_cert_reqs"] == "required"
    assert endpoint.options["ssl_ca_certs"] == "/ca.pem"
    assert endpoint.describe() == "rediss://h:1/0"
    # A plain redis:// URL takes no TLS options from the setting.
    assert "ssl_ca_certs" not in resolve("redis://h:1/0", setting="s",
                                         ssl={"ssl_ca_certs": "/ca.pem"}).options


def test_sentinel_forms_name_the_master_through_the_sentinels() -> None:
    endpoint = resolve(
        "sentinel://:pw@h1:26379/4;sentinel://h2", setting="broker_url",
        transport_options={"master_name": "prod", "sentinel_kwargs": {"password": "s"},
                           "min_other_sentinels": 1},
    )
    assert endpoint.behind_sentinel
    assert endpoint.sentinels == (("h1", 26379), ("h2", 26379))
    assert endpoint.master_name == "prod" and endpoint.db == 4
    assert endpoint.options == {"db": 4, "password": "pw"}
    assert dict(endpoint.sentinel_kwargs) == {"password": "s"}
    assert endpoint.min_other_sentinels == 1
    assert endpoint.describe() == "master 'prod' of the Sentinels h1:26379,h2:26379 (db 4)"
    assert endpoint.identity()[:3] == ("sentinel", frozenset({("h1", 26379), ("h2", 26379)}),
                                       "prod")
    # The master's name may come in the URL's query instead.
    named = resolve("sentinel://h1:1/0?master_name=q", setting="s")
    assert named.master_name == "q"
    # With the broker's TLS, the master is reached over TLS.
    assert resolve("sentinel://h:1", setting="s", transport_options={"master_name": "m"},
                   ssl={"ssl_ca_certs": "/ca"}).options == {"db": 0, "ssl": True,
                                                           "ssl_ca_certs": "/ca"}


def test_a_cluster_is_reached_through_one_node_s_redis_url() -> None:
    node = resolve("redis://h:7000/0", setting="tooleffect_redis_url", cluster=True)
    assert node.cluster and node.url == "redis://h:7000/0"
    assert node != resolve("redis://h:7000/0", setting="tooleffect_redis_url")
    with pytest.raises(ConfigurationError, match="one node's redis:// or rediss:// URL"):
        resolve("unix:///tmp/s", setting="tooleffect_redis_url", cluster=True)


@pytest.mark.parametrize(("url", "transport", "said"), [
    ("", None, "tooleffect_redis_url is empty"),
    (" ; ", None, "tooleffect_redis_url is empty"),
    ("http://127.0.0.1:6390", None, "is not a Redis URL the package can use"),
    ("amqp://guest@h//", None, "is not a Redis URL the package can use"),
    # A list that mixes Sentinels with direct servers is neither.
    ("sentinel://h:1;redis://h:2", None, "is not a Redis URL the package can use"),
    ("redis://h:x/0", None, "is not a valid Redis URL"),
    ("socket://", None, "no socket path"),
    ("rediss://h/0?ssl_bogus=1", None, "unknown TLS option(s) ssl_bogus"),
    ("sentinel://h:1", None, "needs the transport option master_name"),
    ("sentinel://:pw@h/x", {"master_name": "m"}, "has no valid db"),
    ("sentinel://:1", {"master_name": "m"}, "names no Sentinel host"),
    ("sentinel://h:1", {"master_name": "m", "sentinel_kwargs": [1]},
     "sentinel_kwargs must be a mapping"),
])
def test_what_cannot_be_resolved_is_refused_naming_the_setting(
        url: str, transport: dict[str, object] | None, said: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        resolve(url, setting="tooleffect_redis_url", transport_options=transport)
    assert said in str(refused.value)
    assert str(refused.value).startswith("tooleffect_redis_url")


@pytest.mark.parametrize("url", [
    "redis://u:hunter2@h:x/0", "sentinel://:hunter2@h/x", "http://:hunter2@h",
])
def test_a_refusal_never_shows_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        resolve(url, setting="s", transport_options={"master_name": "m"})
    assert "hunter2" not in str(refused.value) and "***" in str(refused.value)


def test_masked_url_masks_every_password_of_a_list() -> None:
    assert masked_url("redis://u:secret@h:1/0;redis://:pw2@h2/0?password=zz&x=1") == (
        "redis://u:***@h:1/0;redis://:***@h2/0?password=***&x=1")
    assert masked_url("redis://user@h/0") == "redis://user@h/0"  # no password: unchanged
    assert masked_url("redis://h/0?PassWord=x") == "redis://h/0?PassWord=***"


@PROPERTIES
@given(user=st.text("abcdefgh", min_size=1, max_size=8),
       password=st.text("ABCDEFGHIJKLMNOP0123456789", min_size=6, max_size=20),
       host=st.sampled_from(["h", "127.0.0.1", "redis.example"]),
       port=st.integers(1, 65535), db=st.integers(0, 15))
def test_a_password_never_survives_masking(user: str, password: str, host: str, port: int,
                                           db: int) -> None:
    url = f"redis://{user}:{password}@{host}:{port}/{db}?password={password}"
    masked = masked_url(url)
    assert password not in masked
    assert masked == f"redis://{user}:***@{host}:{port}/{db}?password=***"
    endpoint = resolve(url, setting="s")
    assert endpoint.options["password"] == password
    assert password not in endpoint.describe()


@PROPERTIES
@given(host=st.sampled_from(["a", "b.example", "10.0.0.1"]), port=st.integers(1, 65535),
       db=st.integers(0, 15), others=st.lists(st.integers(1, 65535), max_size=3))
def test_a_failover_list_always_resolves_to_its_first_server(
        host: str, port: int, db: int, others: list[int]) -> None:
    url = ";".join([f"redis://{host}:{port}/{db}", *(f"redis://z:{p}/0" for p in others)])
    endpoint = resolve(url, setting="broker_url")
    assert endpoint.identity() == (host, port, db, "default", "")
    assert hash(endpoint) == hash(resolve(f"redis://{host}:{port}/{db}", setting="s"))


def test_the_redis_family_is_what_kombu_serves_with_its_redis_transport() -> None:
    assert set(DIRECT_SCHEMES) < set(REDIS_FAMILY)
    for scheme in REDIS_FAMILY:
        assert is_redis_family(f"{scheme}://h")
        assert is_redis_family(f" {scheme.upper()}://h;amqp://x")  # the first part decides
    for other in ("amqp://h", "pyamqp://h", "memory://", "sqs://", ""):
        assert not is_redis_family(other)
    assert scheme_of(" Redis://x;amqp://y") == "redis"


def test_endpoints_are_values() -> None:
    first = resolve("redis://h:1/0", setting="s")
    again = resolve("redis://h:1/0", setting="other")
    assert first == again and hash(first) == hash(again)
    assert len({first, again}) == 1
    assert RedisEndpoint((("host", "h"),)).describe() == "redis://h:6379/0"
