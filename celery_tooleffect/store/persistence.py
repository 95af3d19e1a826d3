"""How much a Redis server keeps when its process or its machine goes down.

A write's intent is the only thing that stops a redelivered write from running
twice, so the package must know what the store keeps across a restart
(``docs/redis.md#durability``):

======================  ==========================  ===============================
mode                    a process crash loses       a machine crash loses
======================  ==========================  ===============================
``aof_always``          nothing                     nothing
``aof_everysec``        nothing                     up to a second of writes
``aof_no``              nothing                     what the OS had not flushed
                                                    (up to about 30 s on Linux)
``aof``                 nothing                     unknown (``INFO`` does not say
                                                    the fsync policy)
``rdb``                 every write since the       the same
                        last snapshot
``none``                everything                  everything
======================  ==========================  ===============================

AOF writes each command to the file (``write(2)``) before the reply leaves the
server, so a killed ``redis-server`` loses nothing under any ``appendfsync``;
``appendfsync`` only decides when the kernel is made to put it on disk.

The mode is read with ``CONFIG GET appendonly appendfsync save`` and, where
CONFIG is refused or renamed (managed Redis), from ``INFO persistence``
(``aof_enabled``; the fsync policy is then unknown, and a server without AOF
is counted as one that can lose what it acknowledged, snapshots or not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..choices import Choice
from ..errors import PersistenceUnreadable


class PersistenceMode(Choice):
    """What a Redis server keeps on disk (see the module's table)."""

    __choice_name__ = "a persistence mode"

    #: AOF, fsynced before each reply.
    AOF_ALWAYS = "aof_always"
    #: AOF, fsynced once a second (Redis's default when AOF is on).
    AOF_EVERYSEC = "aof_everysec"
    #: AOF, fsynced when the OS decides.
    AOF_NO = "aof_no"
    #: AOF, fsync policy unknown (read from ``INFO persistence``).
    AOF = "aof"
    #: RDB snapshots only (``save`` lines, Redis's default).
    RDB = "rdb"
    #: Nothing on disk.
    NONE = "none"

    @property
    def loses_on_process_crash(self) -> bool:
        """Whether a killed ``redis-server`` comes back without writes it acknowledged."""
        return self in (PersistenceMode.RDB, PersistenceMode.NONE)

    @property
    def loses_on_machine_crash(self) -> bool:
        """Whether a crash of the machine can lose writes the server acknowledged."""
        return self is not PersistenceMode.AOF_ALWAYS

    def describe(self) -> str:
        """What the mode keeps, in words (for a log line or a table)."""
        return _WORDS[self]


_WORDS = {
    PersistenceMode.AOF_ALWAYS: "AOF, appendfsync always",
    PersistenceMode.AOF_EVERYSEC: "AOF, appendfsync everysec",
    PersistenceMode.AOF_NO: "AOF, appendfsync no",
    PersistenceMode.AOF: "AOF (appendfsync not readable)",
    PersistenceMode.RDB: "RDB snapshots only, no AOF",
    PersistenceMode.NONE: "no AOF and no RDB snapshots",
}


@dataclass(frozen=True)
class Persistence:
    """A server's persistence as read, and how it was read."""

    mode: PersistenceMode
    #: ``CONFIG GET`` or ``INFO persistence``.
    source: str


def classify(appendonly: str, appendfsync: str, save: str) -> PersistenceMode:
    """The mode of a server whose ``CONFIG GET`` says these three values."""
    if appendonly.strip().lower() == "yes":
        return {
            "always": PersistenceMode.AOF_ALWAYS,
            "everysec": PersistenceMode.AOF_EVERYSEC,
            "no": PersistenceMode.AOF_NO,
        }.get(appendfsync.strip().lower(), PersistenceMode.AOF)
    return PersistenceMode.RDB if save.strip() else PersistenceMode.NONE


def classify_info(info: dict[str, Any]) -> PersistenceMode:
    """The mode a server's ``INFO persistence`` shows: AOF (fsync policy
    unknown), else RDB. ``INFO`` does not show the ``save`` lines, so a server
    without AOF counts as one that snapshots: either way it can lose what it
    acknowledged."""
    if str(info.get("aof_enabled", "0")) == "1":
        return PersistenceMode.AOF
    return PersistenceMode.RDB


def read_persistence(client: Any) -> Persistence:
    """The persistence of the server ``client`` talks to: ``CONFIG GET``, else
    ``INFO persistence``. Raises :class:`PersistenceUnreadable` when neither answers."""
    try:
        config = {_text(k): _text(v) for k, v in client.config_get("appendonly").items()}
        config.update({_text(k): _text(v) for k, v in client.config_get("appendfsync").items()})
        config.update({_text(k): _text(v) for k, v in client.config_get("save").items()})
        if "appendonly" not in config:  # CONFIG renamed to something that answers nothing
            raise KeyError("CONFIG GET appendonly answered nothing")
        return Persistence(classify(config["appendonly"], config.get("appendfsync", ""),
                                    config.get("save", "")), "CONFIG GET")
    except Exception as config_error:
        try:
            info = dict(client.info("persistence"))
        except Exception as info_error:
            raise PersistenceUnreadable(
                f"CONFIG GET: {type(config_error).__name__}: {config_error}; INFO persistence: "
                f"{type(info_error).__name__}: {info_error}") from info_error
        return Persistence(classify_info(info), "INFO persistence")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
