"""What a Redis keeps across a restart, from what CONFIG GET or INFO says
(celery_tooleffect/store/persistence.py): the table of docs/redis.md#durability."""

from __future__ import annotations

import pytest

from celery_tooleffect.store.persistence import PersistenceMode, classify, classify_info


@pytest.mark.parametrize(("appendonly", "appendfsync", "save", "mode"), [
    ("yes", "always", "", PersistenceMode.AOF_ALWAYS),
    ("yes", "everysec", "3600 1 300 100 60 10000", PersistenceMode.AOF_EVERYSEC),
    ("YES", "EverySec", "", PersistenceMode.AOF_EVERYSEC),
    ("yes", "no", "", PersistenceMode.AOF_NO),
    ("yes", "", "", PersistenceMode.AOF),
    ("no", "everysec", "3600 1 300 100 60 10000", PersistenceMode.RDB),
    ("no", "always", "900 1", PersistenceMode.RDB),
    ("no", "everysec", "", PersistenceMode.NONE),
    ("no", "everysec", "  ", PersistenceMode.NONE),
])
def test_config_get_says_the_mode(appendonly: str, appendfsync: str, save: str,
                                  mode: PersistenceMode) -> None:
    assert classify(appendonly, appendfsync, save) is mode


def test_info_persistence_says_aof_or_not() -> None:
    assert classify_info({"aof_enabled": 1}) is PersistenceMode.AOF
    assert classify_info({"aof_enabled": "1"}) is PersistenceMode.AOF
    # INFO does not show the save lines: without AOF, a server that can lose
    # what it acknowledged, snapshots or not.
    assert classify_info({"aof_enabled": 0, "rdb_saves": 0}) is PersistenceMode.RDB
    assert classify_info({}) is PersistenceMode.RDB


@pytest.mark.parametrize(("mode", "process", "machine"), [
    (PersistenceMode.AOF_ALWAYS, False, False),
    (PersistenceMode.AOF_EVERYSEC, False, True),
    (PersistenceMode.AOF_NO, False, True),
    (PersistenceMode.AOF, False, True),
    (PersistenceMode.RDB, True, True),
    (PersistenceMode.NONE, True, True),
])
def test_what_each_mode_loses(mode: PersistenceMode, process: bool, machine: bool) -> None:
    assert mode.loses_on_process_crash is process
    assert mode.loses_on_machine_crash is machine
    assert mode.describe()
