"""Start-up checks of where the store is and how durable its writes are.

- Behind Sentinel, the Sentinels must know a master of the configured name: a
  name they do not know is refused (a typo would otherwise fail every write).
- With ``tooleffect_store_replicas`` / ``tooleffect_store_fsync`` the store
  must accept ``WAIT`` / ``WAITAOF`` (managed Redis may refuse them, Redis
  before 7.2 has no ``WAITAOF``): otherwise every write would fail before its
  body, so the worker refuses to start and says why. More replicas asked for
  than the store has at all (behind Sentinel: than its Sentinels know, down
  ones included) is refused too: it can never work.
- Fewer replicas *in sync* than asked for is a state that changes by itself
  (a replica resyncing, a rolling restart): the worker starts, runs its reads,
  and its writes end before their bodies (``IntentNotDurable``, retried as
  ``connection`` within their budget) until the replicas are back;
  :class:`ReplicaWatch` says so once in the log when it happens and once when
  it ends, and Flower's ``/metrics`` serves the count.
- Without them, a store that has replicas is warned about: a failover can
  promote a replica that never saw a write's intent, and the write would run
  again.
- :func:`persistence_check`: what the store and the dead-letter store keep
  when their process restarts (:mod:`celery_tooleffect.store.persistence`).
  One that can lose what it acknowledged (no AOF) with no replicas waited for
  refuses the start (``tooleffect_allow_volatile_store = True`` makes it a
  loud warning); AOF that a machine crash can cut short is one warning.

A store that does not answer at start is warned about, not refused: writes
fail closed until it is back.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis
from celery import bootsteps

from ..endpoints import RedisEndpoint
from ..errors import PersistenceUnreadable
from ..store.connections import client_for
from ..store.durability import Durability
from ..store.persistence import PersistenceMode, read_persistence
from ..store.runtime import ToolRuntime, runtime_for
from ..store.servers import DEAD_LETTERS, JOURNAL, online_replicas
from .eviction import servers

logger = logging.getLogger(__name__)

#: Seconds between two reads of the store's replicas by a running worker.
REPLICA_CHECK_INTERVAL = 5.0


def ask_sentinels(endpoint: RedisEndpoint, socket_timeout: float, *command: str) -> list[Any]:
    """``command``'s answer from each of ``endpoint``'s Sentinels that answers
    (empty: none did)."""
    answers = []
    for host, port in endpoint.sentinels:
        options = {"socket_timeout": socket_timeout,
                   "socket_connect_timeout": min(socket_timeout, 2.0),
                   **dict(endpoint.sentinel_kwargs)}
        sentinel = redis.Redis(host=host, port=port, **options)
        try:
            answers.append(sentinel.execute_command(*command))  # type: ignore[no-untyped-call]
        except redis.RedisError:
            continue
        finally:
            sentinel.close()
    return answers


def sentinel_refusal(endpoint: RedisEndpoint, role: str, socket_timeout: float) -> str | None:
    """Why ``endpoint``'s Sentinels cannot serve it (None: they can, or none answered)."""
    answers = ask_sentinels(endpoint, socket_timeout,
                            "SENTINEL", "get-master-addr-by-name", endpoint.master_name)
    if answers and not any(answers):
        return (f"{role}: the Sentinels {_hosts(endpoint)} know no master named "
                f"{endpoint.master_name!r} (the transport option master_name)")
    return None


def durability_check(runtime: ToolRuntime) -> tuple[list[str], list[str]]:
    """(refusals, warnings) about the store's Sentinels and replicas."""
    settings = runtime.settings
    refusals: list[str] = []
    warnings: list[str] = []
    stores = {settings.store_endpoint: "the journal and audit store"}
    stores.setdefault(settings.dead_letter_endpoint, "the dead-letter store")
    for endpoint, role in stores.items():
        if endpoint.behind_sentinel:
            refusal = sentinel_refusal(endpoint, role, settings.socket_timeout)
            if refusal:
                refusals.append(refusal)
    if refusals:
        return refusals, warnings
    store = settings.store_endpoint
    durability = Durability.of(settings)
    client = client_for(store, settings.socket_timeout)
    if durability is not None:
        try:
            client.execute_command(*_probe(durability))  # type: ignore[no-untyped-call]
        except redis.ResponseError as refused:
            return [f"the journal and audit store ({store.describe()}) refuses "
                    f"{_probe(durability)[0]} ({refused}): {durability.describe()} cannot be "
                    "waited for (tooleffect_store_replicas, tooleffect_store_fsync)"], warnings
        except redis.RedisError as exc:
            return [], [f"could not check WAIT on the journal and audit store "
                        f"({store.describe()}): {exc}"]
    try:
        connected = online_replicas(client)
    except redis.RedisError as exc:  # INFO may be denied to a restricted user
        return [], [f"could not check the replicas of the journal and audit store "
                    f"({store.describe()}): {exc}"]
    known = known_replicas(store, settings.socket_timeout)
    if durability is not None and known is not None and known < durability.replicas:
        refusals.append(
            f"tooleffect_store_replicas is {durability.replicas} but the Sentinels of the "
            f"journal and audit store ({store.describe()}) know {known} replica(s) in all: "
            "every write would fail before its body; lower it, or add replicas")
    elif durability is not None and connected < durability.replicas:
        warnings.append(short_of_replicas(store.describe(), connected, durability.replicas))
    elif durability is None and connected:
        warnings.append(
            f"the journal and audit store ({store.describe()}) has {connected} replica(s) "
            "and tooleffect_store_replicas is 0: a failover can promote a replica that "
            "never saw a write's intent, and that write would run again "
            "(set tooleffect_store_replicas = 1)")
    return refusals, warnings


def short_of_replicas(where: str, connected: int, wanted: int) -> str:
    """The line said when the store has fewer replicas in sync than asked for."""
    return (f"the journal and audit store ({where}) has {connected} of the {wanted} "
            "replica(s) in sync that tooleffect_store_replicas asks for: reads run, and "
            "writes end before their bodies (retried as connection, within their retry "
            "budget) until the replicas are back in sync")


def known_replicas(endpoint: RedisEndpoint, socket_timeout: float) -> int | None:
    """How many replicas the Sentinels know for ``endpoint``'s master, down ones
    included (None: not behind Sentinel, or no Sentinel answered)."""
    if not endpoint.behind_sentinel:
        return None
    answers = ask_sentinels(endpoint, socket_timeout,
                            "SENTINEL", "replicas", endpoint.master_name)
    return max(len(answer or []) for answer in answers) if answers else None


def persistence_check(runtime: ToolRuntime) -> tuple[list[str], list[str]]:
    """``(refusals, warnings)`` about what the store and the dead-letter store
    keep when their process or machine goes down (see the module docstring)."""
    settings = runtime.settings
    durability = Durability.of(settings)
    refusals: list[str] = []
    warnings: list[str] = []
    for server in servers(runtime):
        where = f"{server.role} ({server.address})"
        lost = CONSEQUENCES_ON_RESTART[server.roles[0]]
        try:
            persistence = read_persistence(server.client)
        except PersistenceUnreadable as exc:
            reason = (f"could not read whether {where} keeps its writes across a restart "
                      f"({exc})")
            if settings.allow_volatile_store:
                warnings.append(f"{reason}; started because tooleffect_allow_volatile_store "
                                "is True")
            else:
                refusals.append(f"{reason}: allow CONFIG GET or INFO persistence to the "
                                "worker's user, or set tooleffect_allow_volatile_store = True "
                                "to accept the risk")
            continue
        mode = persistence.mode
        replicated = JOURNAL in server.roles and durability is not None
        if mode.loses_on_process_crash and not replicated:
            reason = (f"{where} can lose acknowledged writes when its process restarts "
                      f"({mode.describe()}, read by {persistence.source}): {lost}")
            if settings.allow_volatile_store:
                warnings.append(f"VOLATILE STORE ALLOWED (tooleffect_allow_volatile_store = "
                                f"True): {reason}; a rollback it comes back with is detected "
                                "(docs/redis.md#rollbacks); set appendonly yes to remove the "
                                "risk")
            else:
                refusals.append(f"{reason}; set appendonly yes (CONFIG SET appendonly yes, "
                                "and in redis.conf), or tooleffect_allow_volatile_store = "
                                "True to accept the risk")
        elif mode.loses_on_process_crash:
            warnings.append(
                f"{where} can lose acknowledged writes when its process restarts "
                f"({mode.describe()}); each intent waits for its replicas, but a primary "
                "that restarts before a failover comes back from its file and its replicas "
                "copy it (a rollback the worker detects, docs/redis.md#rollbacks): set "
                "appendonly yes")
        elif mode.loses_on_machine_crash and not replicated:
            warnings.append(
                f"{where} runs {mode.describe()}: a crash of its machine (not of the "
                f"process) can lose the last {MACHINE_CRASH_LOSS[mode]} of writes, and "
                "with them intents a redelivered write relies on; for none, set "
                "appendfsync always, or tooleffect_store_fsync = True (Redis 7.2 and "
                "later), or tooleffect_store_replicas")
    return refusals, warnings


#: What a server of each role loses with its writes.
CONSEQUENCES_ON_RESTART = {
    JOURNAL: "the journal would forget intents and outcomes, and a redelivered write would "
             "run again",
    DEAD_LETTERS: "dead letters (and, on the broker, queued messages) would be lost",
}

#: How much of its last writes an AOF server can lose with its machine.
MACHINE_CRASH_LOSS = {
    PersistenceMode.AOF_EVERYSEC: "second",
    PersistenceMode.AOF_NO: "30 seconds or so (when the OS flushes)",
    PersistenceMode.AOF: "second or more (its appendfsync could not be read)",
}


class ReplicaWatch(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker step, when ``tooleffect_store_replicas`` is set: reads the store's
    replicas in sync every :data:`REPLICA_CHECK_INTERVAL` seconds in the
    worker's main process, and logs once when they fall short of the setting
    (writes then end before their bodies) and once when they are back."""

    name = "celery_tooleffect.replica_watch"
    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None
        self.short = False

    def start(self, worker: Any) -> None:
        try:
            runtime = runtime_for(worker.app)
            durability = Durability.of(runtime.settings)
            if durability is None or not durability.replicas:
                return
            store = runtime.settings.store_endpoint
            client = client_for(store, runtime.settings.socket_timeout)
        except Exception as exc:  # never stops the worker
            logger.warning("celery-tooleffect: the store's replicas are not watched: %r; see "
                           "docs/operations.md#replicas", exc)
            return
        wanted, where = durability.replicas, store.describe()

        def check() -> None:
            try:
                connected = online_replicas(client)
            except Exception as exc:
                logger.debug("celery-tooleffect: replicas of %s not read: %r", where, exc)
                return
            if connected < wanted and not self.short:
                self.short = True
                logger.warning("celery-tooleffect: %s; see docs/operations.md#replicas",
                               short_of_replicas(where, connected, wanted))
            elif connected >= wanted and self.short:
                self.short = False
                logger.warning("celery-tooleffect: the journal and audit store (%s) has %d "
                               "replica(s) in sync again: writes run; see "
                               "docs/operations.md#replicas", where, connected)

        # Short at start: the start-up check said so already.
        with contextlib.suppress(Exception):
            self.short = online_replicas(client) < wanted
        self.tref = worker.timer.call_repeatedly(REPLICA_CHECK_INTERVAL, check)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


def _probe(durability: Durability) -> tuple[str, ...]:
    """A WAIT / WAITAOF that returns at once: does the store accept it?"""
    return ("WAITAOF", "0", "0", "0") if durability.fsync else ("WAIT", "0", "0")


def _hosts(endpoint: RedisEndpoint) -> str:
    return ",".join(f"{host}:{port}" for host, port in endpoint.sentinels)
