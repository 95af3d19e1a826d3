"""The suite's own guard (tests/conftest.py): an app of the suite names every
server it uses; none is left to a default."""

from __future__ import annotations

import pytest

from tests.conftest import (
    DefaultServerRefused,
    app_config,
    refuse_defaults,
    spawned_setting,
)

NAMED_STORE = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(("conf", "said"), [
    ({"broker_url": ""}, "no broker_url"),
    ({"broker_url": None}, "no broker_url"),
    ({"broker_url": "amqp://guest@h/te-x"}, "no tooleffect_redis_url"),
    ({"broker_url": "memory://"}, "no tooleffect_redis_url"),
    ({"broker_url": "amqp://guest@h//", "tooleffect_redis_url": NAMED_STORE},
     "default virtual host"),
    ({"broker_url": "pyamqp://guest@h:5672", "tooleffect_redis_url": NAMED_STORE},
     "default virtual host"),
])
def test_settings_that_leave_a_server_to_a_default_are_refused(
        conf: dict[str, object], said: str) -> None:
    with pytest.raises(DefaultServerRefused, match=said):
        refuse_defaults(conf)


@pytest.mark.parametrize("conf", [
    {"broker_url": "redis://h:1/0"},  # the store follows the broker
    {"broker_url": "sentinel://h:1;sentinel://g:2"},
    {"broker_url": "amqp://guest@h/te-x", "tooleffect_redis_url": NAMED_STORE},
    {"broker_url": "memory://", "tooleffect_redis_url": NAMED_STORE},
])
def test_settings_that_name_their_servers_pass(conf: dict[str, object]) -> None:
    refuse_defaults(conf)


def test_the_suite_s_app_config_refuses_too() -> None:
    assert app_config("p:", broker_url=NAMED_STORE)["broker_url"] == NAMED_STORE
    with pytest.raises(DefaultServerRefused):
        app_config("p:", broker_url="amqp://guest@h/te-x")


def test_a_spawned_app_is_told_its_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_BROKER", NAMED_STORE)
    assert spawned_setting("TE_BROKER") == NAMED_STORE
    monkeypatch.setenv("TE_BROKER", "")
    with pytest.raises(DefaultServerRefused, match="TE_BROKER is not set"):
        spawned_setting("TE_BROKER")
    monkeypatch.delenv("TE_BROKER")
    with pytest.raises(DefaultServerRefused):
        spawned_setting("TE_BROKER")
