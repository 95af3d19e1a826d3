"""Whether Redis may evict the package's keys: checked at worker start, watched while
running.

A Redis with ``maxmemory`` set evicts keys under every ``maxmemory-policy`` but
``noeviction``; the package's keys all carry TTLs, so the ``volatile-*``
policies evict them too. An evicted journal entry lets an interrupted write run
again, an evicted dead letter can be neither replayed nor inspected. So:

- at worker start (:func:`eviction_check`, from the ``StartupChecks`` step) the
  store's and the dead-letter store's ``maxmemory-policy`` and ``maxmemory`` are
  read (``CONFIG GET``; where it is refused or renamed, as on managed Redis,
  ``INFO memory``), each server once. An evicting policy with ``maxmemory`` set
  refuses the start (``tooleffect_allow_eviction = True`` turns that into a loud
  warning); with ``maxmemory 0`` it is a warning; a server whose settings cannot
  be read is a warning too;
- while running (:class:`EvictionWatch`, a step of the worker's main process on
  its timer) ``evicted_keys`` of ``INFO stats`` is read every
  :data:`CHECK_INTERVAL` seconds; a rise since the worker started is logged
  once per server, as a WARNING;
- Flower's ``/metrics`` serves ``tooleffect_store_evicted_keys{store}`` and
  ``tooleffect_store_maxmemory_policy_evicting{store}``
  (:func:`~celery_tooleffect.store.servers.role_readings`), ``store`` being
  ``journal`` or ``dead_letters``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from ..store.runtime import ToolRuntime, runtime_for
from ..store.servers import (
    DEAD_LETTERS,
    JOURNAL,
    Server,
    policy_evicts,
    servers_of,
    text,
)

logger = logging.getLogger(__name__)

#: Seconds between two reads of ``evicted_keys`` by a running worker.
CHECK_INTERVAL = 30.0

CONSEQUENCES = {
    JOURNAL: "Redis may evict a journal entry and an interrupted write would run again",
    DEAD_LETTERS: "Redis may evict a dead letter, which could then be neither replayed "
                  "nor inspected",
}

#: :func:`verdict`'s answers.
OK, WARN, REFUSE = "ok", "warn", "refuse"


def verdict(policy: str, maxmemory: int) -> str:
    """:data:`REFUSE` for an evicting policy with ``maxmemory`` set, :data:`WARN`
    for one without (it evicts as soon as ``maxmemory`` is set), else :data:`OK`."""
    if not policy_evicts(policy):
        return OK
    return REFUSE if maxmemory > 0 else WARN


def human_bytes(size: int) -> str:
    """``size`` as Redis writes it in its configuration (``100mb``, ``1gb``)."""
    for unit, factor in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size} bytes"


def servers(runtime: ToolRuntime) -> list[Server]:
    """:func:`servers_of` the app's store and dead letters."""
    return servers_of(runtime.audit.client, runtime.dead_letters.client)


def memory_policy(client: Any) -> tuple[str, int]:
    """``(maxmemory-policy, maxmemory)`` of the server: ``CONFIG GET``, else ``INFO memory``."""
    try:
        config = client.config_get("maxmemory*")
        return text(config["maxmemory-policy"]), int(config["maxmemory"])
    except Exception:  # CONFIG refused or renamed (managed Redis): INFO says it too
        info = client.info("memory")
        return text(info["maxmemory_policy"]), int(info["maxmemory"])


def eviction_check(runtime: ToolRuntime) -> tuple[list[str], list[str]]:
    """``(refusals, warnings)`` for the servers of the store and the dead letters."""
    refusals: list[str] = []
    warnings: list[str] = []
    for server in servers(runtime):
        where = f"{server.role} ({server.address})"
        try:
            policy, maxmemory = memory_policy(server.client)
        except Exception as exc:
            warnings.append(
                f"could not check whether {where} can evict keys (neither CONFIG GET nor "
                f"INFO memory answered: {type(exc).__name__}: {exc}); run it with "
                "maxmemory-policy noeviction"
            )
            continue
        decision = verdict(policy, maxmemory)
        consequence = CONSEQUENCES[server.roles[0]]
        if decision == REFUSE:
            reason = (f"{where} has maxmemory-policy {policy} with maxmemory "
                      f"{human_bytes(maxmemory)}: {consequence}")
            if runtime.settings.allow_eviction:
                warnings.append(f"EVICTION ALLOWED (tooleffect_allow_eviction = True): {reason}; "
                                "set maxmemory-policy noeviction to remove the risk")
            else:
                refusals.append(f"{reason}; set maxmemory-policy noeviction, or "
                                "tooleffect_allow_eviction = True to accept the risk")
        elif decision == WARN:
            warnings.append(
                f"{where} has maxmemory-policy {policy} and no maxmemory yet (0): once "
                f"maxmemory is set, {consequence}; set maxmemory-policy noeviction"
            )
    return refusals, warnings


class EvictionWatcher:
    """Reads ``evicted_keys`` of each server; logs a rise once per server."""

    def __init__(self, found: list[Server]) -> None:
        self.servers = found
        self.baseline: dict[str, int] = {}
        self.warned: set[str] = set()

    def check(self) -> None:
        """One ``INFO stats`` per server not warned about yet. Never raises."""
        for server in self.servers:
            if server.address in self.warned:
                continue
            try:
                evicted = int(server.client.info("stats").get("evicted_keys", 0))
            except Exception as exc:
                logger.debug("celery-tooleffect: evicted_keys of %s not read: %r",
                             server.address, exc)
                continue
            first = self.baseline.setdefault(server.address, evicted)
            if evicted < first:  # the server restarted: its counter did too
                self.baseline[server.address] = evicted
            elif evicted > first:
                self.warned.add(server.address)
                logger.warning(
                    "celery-tooleffect: %s (%s) has evicted %d key(s) since this worker "
                    "started (evicted_keys %d): %s; set maxmemory-policy noeviction "
                    "(logged once); see docs/operations.md#eviction",
                    server.role, server.address, evicted - first, evicted,
                    CONSEQUENCES[server.roles[0]],
                )


class EvictionWatch(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker step: an :class:`EvictionWatcher` on the worker's timer, every
    :data:`CHECK_INTERVAL` seconds, in the worker's main process."""

    name = "celery_tooleffect.eviction_watch"
    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        try:
            watcher = EvictionWatcher(servers(runtime_for(worker.app)))
        except Exception as exc:  # never stops the worker
            logger.warning("celery-tooleffect: evictions are not watched: %r; see "
                           "docs/operations.md#eviction", exc)
            return
        watcher.check()  # the counts at start
        self.tref = worker.timer.call_repeatedly(CHECK_INTERVAL, watcher.check)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
