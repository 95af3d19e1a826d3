"""Settings resolution (celery_tooleffect/settings.py): where the store is,
the defaults, and every refusal, read from a Celery app that is never
connected."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect import settings as package_settings
from celery_tooleffect.errors import ConfigurationError
from celery_tooleffect.settings import (
    DEFAULTS,
    PRIVACY_LEVELS,
    Settings,
    atomic_fetch_enabled,
    default_release,
    refuse_unknown_settings,
    settings_for,
)
from tests.conftest import PACKAGE_DEFAULT_STORE_URL, REFUSED_DEFAULT_STORE
from tests.unit.conftest import NOWHERE, app_with

#: The settings table: the package's documented defaults.
CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

PROPERTIES = settings(max_examples=200, deadline=None, database=None)


def test_the_defaults() -> None:
    resolved = settings_for(app_with())
    assert resolved.key_prefix == "tooleffect:"
    assert (resolved.max_retries, resolved.backoff_base, resolved.backoff_cap) == (3, 30.0, 600.0)
    assert resolved.privacy == "metadata"
    assert resolved.retention == 7 * 24 * 3600
    assert (resolved.run_stream_maxlen, resolved.global_stream_maxlen) == (10_000, 100_000)
    assert resolved.socket_timeout == 5.0
    assert resolved.heartbeat_interval is None
    assert resolved.rabbitmq_consumer_timeout == 1800.0
    assert resolved.reconcile_timeout == 30.0
    assert resolved.approval_timeout == 24 * 3600.0
    assert resolved.approval_retention == 7 * 24 * 3600.0
    assert not resolved.allow_eviction and not resolved.redis_cluster
    assert (resolved.store_replicas, resolved.store_fsync, resolved.store_wait_timeout) == (
        0, False, 1.0)
    assert resolved.atomic_fetch  # on by default on a Redis broker
    assert resolved.visibility_timeout == 3600.0  # kombu's default
    assert resolved.default_queue == "celery"
    assert dict(resolved.failure_classes) == {}
    # Every default is a key of DEFAULTS, and only those are known.
    assert all(key.startswith("tooleffect_") for key in DEFAULTS)


def test_settings_are_read_once_per_app() -> None:
    app = app_with()
    assert settings_for(app) is settings_for(app)
    assert settings_for(app) is not settings_for(app_with())


def test_the_store_follows_a_redis_broker() -> None:
    resolved = settings_for(app_with(broker_url="redis://u:pw@h:1/4"))
    assert resolved.broker_is_redis
    assert resolved.redis_url == resolved.broker_url == resolved.dead_letter_url
    assert resolved.store == resolved.broker_redis == resolved.dead_letter_store
    assert resolved.store_endpoint.identity() == ("h", 1, 4, "u", "pw")


def test_a_store_of_its_own_keeps_the_dead_letters_on_the_broker() -> None:
    resolved = settings_for(app_with(broker_url="redis://b:1/0",
                                     tooleffect_redis_url="redis://s:2/3"))
    assert resolved.redis_url == "redis://s:2/3"
    assert resolved.store_endpoint.identity() == ("s", 2, 3, "default", "")
    # Dead letters live where the message is: the broker's Redis.
    assert resolved.dead_letter_url == "redis://b:1/0"
    assert resolved.dead_letter_endpoint.identity() == ("b", 1, 0, "default", "")


def test_on_rabbitmq_a_named_store_keeps_the_dead_letters_too() -> None:
    resolved = settings_for(app_with(broker_url="amqp://g@h/v",
                                     tooleffect_redis_url="redis://s:2/3"))
    assert not resolved.broker_is_redis and resolved.broker_redis is None
    assert not resolved.atomic_fetch  # a Redis broker's fetch only
    assert resolved.dead_letter_url == resolved.redis_url == "redis://s:2/3"
    assert resolved.dead_letter_store == resolved.store


def test_on_rabbitmq_without_a_store_the_package_takes_its_documented_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's default store is the one docs/configuration.md documents,
    asserted with the suite's guard lifted (tests/conftest.py refuses it in
    every process of the suite); nothing connects to it."""
    row = next(line for line in CONFIGURATION.read_text().splitlines()
               if line.startswith("| `tooleffect_redis_url` |"))
    documented = re.search(r"else `([^`]+)`", row)
    assert documented is not None, row
    assert documented.group(1) == PACKAGE_DEFAULT_STORE_URL
    monkeypatch.setattr(package_settings, "DEFAULT_STORE_URL", PACKAGE_DEFAULT_STORE_URL)
    resolved = settings_for(app_with(broker_url="amqp://g@h/v"))
    assert resolved.redis_url == resolved.dead_letter_url == PACKAGE_DEFAULT_STORE_URL
    parts = urllib.parse.urlsplit(PACKAGE_DEFAULT_STORE_URL)
    assert resolved.store_endpoint.identity() == (parts.hostname, parts.port,
                                                  int(parts.path.strip("/")), "default", "")


def test_the_suite_refuses_the_default_store_in_its_own_processes() -> None:
    """The guard of tests/conftest.py: an app of the suite on RabbitMQ that
    names no store is refused, naming the setting, instead of writing to
    whatever Redis answers at the package's default store."""
    assert package_settings.DEFAULT_STORE_URL == REFUSED_DEFAULT_STORE
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(broker_url="amqp://g@h/v"))
    assert "tooleffect_redis_url" in str(refused.value)
    assert "refuses the package's default store" in str(refused.value)


@pytest.mark.parametrize(("conf", "said"), [
    ({"tooleffect_max_retry": 3}, "unknown setting(s) tooleffect_max_retry"),
    ({"tooleffect_effect": "read_only"}, "a tool's effect is declared in code"),
    ({"tooleffect_privacy": "everything"}, "tooleffect_privacy must be one of"),
    ({"tooleffect_redis_cluster": True}, "tooleffect_redis_cluster needs tooleffect_redis_url"),
    ({"tooleffect_atomic_fetch": "yes"}, "tooleffect_atomic_fetch must be True or False"),
    ({"tooleffect_allow_volatile_store": "yes"},
     "tooleffect_allow_volatile_store must be True or False, not 'yes'"),
    ({"tooleffect_allow_volatile_store": 1},
     "tooleffect_allow_volatile_store must be True or False, not 1"),
    ({"tooleffect_store_replicas": -1}, "tooleffect_store_replicas must be a whole number"),
    ({"tooleffect_store_replicas": True}, "tooleffect_store_replicas must be a whole number"),
    ({"tooleffect_store_replicas": 1.5}, "tooleffect_store_replicas must be a whole number"),
    ({"tooleffect_store_replicas": 1, "tooleffect_store_wait_timeout": 5},
     "must be above 0 and below tooleffect_socket_timeout"),
    ({"tooleffect_store_fsync": True, "tooleffect_store_wait_timeout": 0},
     "must be above 0 and below tooleffect_socket_timeout"),
    ({"tooleffect_redis_cluster": True, "tooleffect_redis_url": "redis://h:7000",
      "tooleffect_store_replicas": 1}, "not supported on a Redis Cluster store"),
    ({"tooleffect_redis_url": "http://h:1"}, "tooleffect_redis_url: http://h:1 is not a Redis"),
    ({"broker_url": "redis://u:hunter2@h:x/0"}, "broker_url: redis://u:***@h:x/0"),
])
def test_a_setting_the_package_cannot_use_is_refused(conf: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(**conf))
    assert said in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_unknown_settings_are_found_in_any_case_and_known_ones_pass() -> None:
    refuse_unknown_settings({**DEFAULTS, "TOOLEFFECT_MAX_RETRIES": 1, "broker_url": "x",
                             3: "not text"})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="TOOLEFFECT_BOGUS, tooleffect_other"):
        refuse_unknown_settings({"tooleffect_other": 1, "TOOLEFFECT_BOGUS": 2})


def test_what_each_setting_becomes() -> None:
    resolved = settings_for(app_with(
        broker_transport_options={"visibility_timeout": 60, "global_keyprefix": "p:"},
        task_default_queue="tools", tooleffect_key_prefix="x:", tooleffect_privacy="FULL",
        tooleffect_heartbeat_interval=0.5, tooleffect_atomic_fetch=False,
        tooleffect_max_retries="5", tooleffect_failure_classes={"a.B": "auth"},
        tooleffect_release="2024.1", tooleffect_allow_eviction=1,
    ))
    assert resolved.visibility_timeout == 60.0
    assert resolved.broker_transport_options["global_keyprefix"] == "p:"
    assert resolved.default_queue == "tools"
    assert resolved.key_prefix == "x:"
    assert resolved.privacy == "full" and resolved.privacy in PRIVACY_LEVELS
    assert resolved.heartbeat_interval == 0.5
    assert not resolved.atomic_fetch
    assert resolved.max_retries == 5
    assert dict(resolved.failure_classes) == {"a.B": "auth"}
    assert resolved.release == "2024.1"
    assert resolved.allow_eviction is True
    # A heartbeat interval of 0 is none.
    assert settings_for(app_with(tooleffect_heartbeat_interval=0)).heartbeat_interval is None


def test_a_store_behind_sentinel_waits_for_a_replica_by_default() -> None:
    sentinel = {"broker_url": "sentinel://h:1/0", "broker_transport_options": {
        "master_name": "m"}}
    assert settings_for(app_with(**sentinel)).store_replicas == 1
    assert settings_for(app_with(**sentinel, tooleffect_store_replicas=0)).store_replicas == 0
    direct = settings_for(app_with(tooleffect_store_replicas=2, tooleffect_store_fsync=True,
                                   tooleffect_socket_timeout=3, tooleffect_store_wait_timeout=2))
    assert (direct.store_replicas, direct.store_fsync, direct.store_wait_timeout) == (2, True, 2.0)


def test_atomic_fetch_is_on_unless_set_to_false() -> None:
    assert atomic_fetch_enabled({})
    assert atomic_fetch_enabled({"tooleffect_atomic_fetch": None})
    assert atomic_fetch_enabled({"tooleffect_atomic_fetch": True})
    assert not atomic_fetch_enabled({"tooleffect_atomic_fetch": False})
    for value in (0, 1, "false", "True"):
        with pytest.raises(ConfigurationError):
            atomic_fetch_enabled({"tooleffect_atomic_fetch": value})


@pytest.mark.parametrize(("main", "release"), [
    ("celery_tooleffect.demo", importlib.metadata.version("celery-tooleffect")),
    ("json.tools", __import__("json").__version__),  # no distribution: the module's version
    ("no_such_package_here.tasks", ""),
    ("__main__", ""),
    (None, ""),
])
def test_the_default_release_is_the_app_s_distribution_version(
        main: str | None, release: str) -> None:
    app = Celery(main, set_as_current=False)
    app.conf.broker_url = NOWHERE
    assert default_release(app) == release
    assert settings_for(app).release == release
    app.conf.tooleffect_release = ""
    assert default_release(app) == release  # the function ignores the setting


def _base() -> Settings:
    return settings_for(app_with())


@PROPERTIES
@given(base=st.floats(0.01, 100), cap=st.floats(0.01, 1000), retries=st.integers(0, 40))
def test_backoff_doubles_up_to_its_cap(base: float, cap: float, retries: int) -> None:
    policy = dataclasses.replace(_base(), backoff_base=base, backoff_cap=cap)
    wait = policy.backoff(retries)
    assert 0 < wait <= cap
    assert wait == min(base * 2 ** retries, cap)
    assert policy.backoff(retries + 1) >= wait  # never shorter


@PROPERTIES
@given(retention=st.integers(0, 10**7), visibility=st.floats(1, 10**5),
       retries=st.integers(0, 20), cap=st.floats(0, 10**4), approval=st.floats(0, 10**6),
       listed=st.floats(0, 10**8))
def test_a_journal_entry_outlives_every_redelivery_of_its_message(
        retention: int, visibility: float, retries: int, cap: float, approval: float,
        listed: float) -> None:
    resolved = dataclasses.replace(_base(), retention=retention, visibility_timeout=visibility,
                                   max_retries=retries, backoff_cap=cap,
                                   approval_timeout=approval, approval_retention=listed)
    ttl = resolved.journal_ttl
    assert ttl >= retention
    assert ttl >= int(visibility * (retries + 2) + cap * retries)
    assert ttl == int(max(retention, visibility * (retries + 2) + cap * retries))
    # An approval record outlives its timeout, then its journal entry's life and
    # the time its decision stays listed.
    assert resolved.approval_ttl >= int(approval) + ttl
    assert resolved.approval_ttl >= int(approval) + listed
    assert resolved.approval_ttl == int(approval) + max(ttl, math.ceil(listed))


@pytest.mark.parametrize("value", [-1, "soon", True, float("inf")])
def test_the_approval_retention_is_a_number_of_seconds(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="tooleffect_approval_retention"):
        settings_for(app_with(tooleffect_approval_retention=value))
    assert settings_for(app_with(tooleffect_approval_retention=0)).approval_retention == 0.0
    assert settings_for(app_with(tooleffect_approval_retention="60")).approval_retention == 60.0


def test_hand_made_settings_resolve_their_endpoints_from_their_urls() -> None:
    made = dataclasses.replace(_base(), store=None, dead_letter_store=None,
                               redis_url="redis://s:2/1", dead_letter_url="redis://d:3/0")
    assert made.store_endpoint.identity() == ("s", 2, 1, "default", "")
    assert made.dead_letter_endpoint.identity() == ("d", 3, 0, "default", "")


@pytest.mark.parametrize(("conf", "said", "unsaid"), [
    ({"tooleffect_max_retry": 3},
     "unknown setting(s) tooleffect_max_retry (did you mean tooleffect_max_retries?)",
     ("tooleffect_backoff_cap", "effect is declared")),
    ({"tooleffect_privacy_level": "full"}, "(did you mean tooleffect_privacy?)",
     ("effect is declared",)),
    ({"tooleffect_effect": "read_only"}, "a tool's effect is declared in code",
     ("did you mean",)),
    ({"tooleffect_nothing_like_it": 1}, "celery-tooleffect settings are "
     "tooleffect_agent_approval_wait, ", ("did you mean", "effect is declared")),
])
def test_a_misspelt_setting_is_told_the_one_it_likely_meant(
        conf: dict[str, Any], said: str, unsaid: tuple[str, ...]) -> None:
    """An unknown setting names the closest one; the full list only when none
    is close, the word on effects only for a key about effects."""
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(**conf))
    assert said in str(refused.value)
    for text in unsaid:
        assert text not in str(refused.value)


def test_the_settings_table_lists_every_setting_and_only_those() -> None:
    documented = set(re.findall(r"^\| `(tooleffect_[a-z_]+)` \|", CONFIGURATION.read_text(),
                                flags=re.MULTILINE))
    assert documented == set(DEFAULTS)


def test_the_dead_letter_thresholds() -> None:
    resolved = settings_for(app_with())
    assert (resolved.dead_letter_warn_count, resolved.dead_letter_warn_age) == (100, 86400.0)
    set_ = settings_for(app_with(tooleffect_dead_letter_warn_count=0,
                                 tooleffect_dead_letter_warn_age="3600"))
    assert (set_.dead_letter_warn_count, set_.dead_letter_warn_age) == (0, 3600.0)


@pytest.mark.parametrize(("key", "value", "said"), [
    ("tooleffect_dead_letter_warn_count", -1, "a whole number, 0 or more, not -1"),
    ("tooleffect_dead_letter_warn_count", "many", "a whole number, 0 or more, not 'many'"),
    ("tooleffect_dead_letter_warn_count", 2.5, "a whole number, 0 or more, not 2.5"),
    ("tooleffect_dead_letter_warn_count", True, "a whole number, 0 or more, not True"),
    ("tooleffect_dead_letter_warn_age", -60, "a number of seconds, 0 or more, not -60"),
    ("tooleffect_dead_letter_warn_age", "a day", "a number of seconds, 0 or more, not 'a day'"),
    ("tooleffect_dead_letter_warn_age", float("inf"), "0 or more, not inf"),
])
def test_a_bad_dead_letter_threshold_is_refused_naming_its_smallest_value(
        key: str, value: Any, said: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(**{key: value}))
    assert str(refused.value).startswith(f"{key} must be")
    assert said in str(refused.value)


@pytest.mark.parametrize("value", [60, 19799, -1, 0, "a week", "604800", True, float("inf"),
                                   [604800]])
def test_a_retention_below_the_journals_minimum_is_refused(value: Any) -> None:
    # Defaults: a visibility timeout of 3600 s, 3 retries, a 600 s backoff cap:
    # 3600 x 5 + 600 x 3 = 19800 s.
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(tooleffect_retention=value))
    assert str(refused.value).startswith(
        "tooleffect_retention must be a number of seconds, 19800 or more (the journal's "
        "minimum: visibility_timeout x (max_retries + 2) + backoff_cap x max_retries)")


def test_the_journals_minimum_follows_the_lease_and_retry_budget() -> None:
    conf = dict(broker_transport_options={"visibility_timeout": 60}, tooleffect_max_retries=2,
                tooleffect_backoff_cap=0.5)
    # 60 x 4 + 0.5 x 2 = 241 s: the smallest retention allowed, and the journal's TTL.
    resolved = settings_for(app_with(tooleffect_retention=241, **conf))
    assert resolved.journal_minimum == 241
    assert resolved.retention == resolved.journal_ttl == 241
    with pytest.raises(ConfigurationError, match=r"241 or more .* not 240"):
        settings_for(app_with(tooleffect_retention=240, **conf))
    assert settings_for(app_with(tooleffect_retention=19800)).retention == 19800
    assert settings_for(app_with(tooleffect_retention=86400.0)).retention == 86400


def test_an_unset_retention_grows_with_a_long_visibility_timeout() -> None:
    # 2 days x 5 + 600 x 3: more than the 7 days of the default, which is not
    # refused (the operator chose nothing) but grows to the journal's minimum.
    long_lease = {"visibility_timeout": 2 * 86400}
    resolved = settings_for(app_with(broker_transport_options=long_lease))
    assert resolved.retention == resolved.journal_ttl == 2 * 86400 * 5 + 600 * 3
    with pytest.raises(ConfigurationError, match="865800 or more"):
        settings_for(app_with(broker_transport_options=long_lease,
                              tooleffect_retention=7 * 24 * 3600))


@pytest.mark.parametrize(("key", "value", "said"), [
    ("tooleffect_run_stream_maxlen", 0, "a whole number, 1 or more, not 0"),
    ("tooleffect_run_stream_maxlen", -5, "a whole number, 1 or more, not -5"),
    ("tooleffect_run_stream_maxlen", "lots", "a whole number, 1 or more, not 'lots'"),
    ("tooleffect_run_stream_maxlen", 2.5, "a whole number, 1 or more, not 2.5"),
    ("tooleffect_global_stream_maxlen", -1, "a whole number, 1 or more, not -1"),
    ("tooleffect_global_stream_maxlen", None, None),  # unset: the default
    ("tooleffect_global_stream_maxlen", [1], "a whole number, 1 or more, not [1]"),
    ("tooleffect_agent_max_argument_bytes", 0, "a whole number, 1 or more, not 0"),
    ("tooleffect_agent_max_argument_bytes", "1k", "a whole number, 1 or more, not '1k'"),
    ("tooleffect_max_retries", -1, "a whole number, 0 or more, not -1"),
    ("tooleffect_max_retries", "three", "a whole number, 0 or more, not 'three'"),
    ("tooleffect_max_retries", True, "a whole number, 0 or more, not True"),
    ("tooleffect_backoff_base", -1, "a number of seconds, 0 or more, not -1"),
    ("tooleffect_backoff_cap", "ten", "a number of seconds, 0 or more, not 'ten'"),
    ("tooleffect_approval_timeout", -3600, "a number of seconds, 0 or more, not -3600"),
    ("tooleffect_agent_approval_wait", "soon", "a number of seconds, 0 or more, not 'soon'"),
    ("tooleffect_agent_result_wait", -1, "a number of seconds, 0 or more, not -1"),
    ("tooleffect_store_wait_timeout", "x", "a number of seconds, 0 or more, not 'x'"),
    ("tooleffect_socket_timeout", 0, "a number of seconds above 0, not 0"),
    ("tooleffect_socket_timeout", "fast", "a number of seconds above 0, not 'fast'"),
    ("tooleffect_rabbitmq_consumer_timeout", -1, "a number of seconds above 0, not -1"),
    ("tooleffect_reconcile_timeout", float("nan"), "a number of seconds above 0, not nan"),
    ("tooleffect_heartbeat_interval", -2, "a number of seconds above 0, not -2"),
    ("tooleffect_heartbeat_interval", "often", "a number of seconds above 0, not 'often'"),
])
def test_a_bad_size_or_threshold_is_refused_naming_its_smallest_value(
        key: str, value: Any, said: str | None) -> None:
    if said is None:
        assert settings_for(app_with(**{key: value})) is not None
        return
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(**{key: value}))
    assert str(refused.value) == f"{key} must be {said}"


def test_sizes_and_thresholds_given_as_text_or_whole_floats_are_read() -> None:
    resolved = settings_for(app_with(tooleffect_run_stream_maxlen="500",
                                     tooleffect_global_stream_maxlen=2000.0,
                                     tooleffect_socket_timeout="2.5",
                                     tooleffect_backoff_cap="60"))
    assert (resolved.run_stream_maxlen, resolved.global_stream_maxlen) == (500, 2000)
    assert (resolved.socket_timeout, resolved.backoff_cap) == (2.5, 60.0)


def test_the_audit_key_is_the_setting_or_the_file(tmp_path: Path) -> None:
    assert settings_for(app_with()).audit_key is None
    key = "k" * 32
    assert settings_for(app_with(tooleffect_audit_key=key)).audit_key == key.encode()
    assert settings_for(app_with(tooleffect_audit_key=key.encode())).audit_key == key.encode()
    path = tmp_path / "audit.key"
    path.write_text(key + "\n")
    resolved = settings_for(app_with(tooleffect_audit_key_file=str(path)))
    assert resolved.audit_key == key.encode()
    assert key not in repr(resolved)  # never shown
    assert settings_for(app_with(tooleffect_audit_key_file=path)).audit_key == key.encode()


@pytest.mark.parametrize(("conf", "said"), [
    ({"tooleffect_audit_key": "short"},
     "tooleffect_audit_key must be at least 16 bytes (e.g. secrets.token_hex(32)), not 5"),
    ({"tooleffect_audit_key": 12345678901234567890},
     "tooleffect_audit_key must be a secret (text or bytes), not a int"),
    ({"tooleffect_audit_key": "k" * 32, "tooleffect_audit_key_file": "/x"},
     "tooleffect_audit_key and tooleffect_audit_key_file are both set: give one"),
    ({"tooleffect_audit_key_file": "/nonexistent/audit.key"},
     "tooleffect_audit_key_file '/nonexistent/audit.key' cannot be read: "
     "No such file or directory"),
    ({"tooleffect_audit_key_file": 3}, "tooleffect_audit_key_file must be the path of a file"),
])
def test_a_bad_audit_key_is_refused(conf: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(**conf))
    assert str(refused.value).startswith(said)


def test_a_short_audit_key_file_is_refused_without_showing_it(tmp_path: Path) -> None:
    path = tmp_path / "audit.key"
    path.write_bytes(b"s3cret\n\n")
    with pytest.raises(ConfigurationError) as refused:
        settings_for(app_with(tooleffect_audit_key_file=str(path)))
    assert str(refused.value) == (
        "tooleffect_audit_key_file must be at least 16 bytes (e.g. secrets.token_hex(32)), not 6")
