"""The store's gauges on Flower's ``/metrics`` (:class:`StoreGauges`), read at
each scrape: the calls awaiting approval, the dead letters of each
combination, the oldest dead letter's age, what ``INFO`` says of evictions,
and the store's sizing (sampled, and cached between scrapes).

It imports prometheus_client, never Flower or tornado.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import prometheus_client
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from ...store.dead_letters import DeadLetters
from ...store.persistence import read_persistence
from ...store.servers import JOURNAL, online_replicas, role_readings, servers_of
from ..approvals import Approvals
from ..sizing import Sizing, measure_store

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The gauges on Flower's ``/metrics`` (:class:`StoreGauges`).
APPROVALS_GAUGE = "tooleffect_approvals_pending"
DEAD_LETTERS_GAUGE = "tooleffect_dead_letters"
OLDEST_DEAD_LETTER_GAUGE = "tooleffect_oldest_dead_letter_age_seconds"
EVICTED_KEYS_GAUGE = "tooleffect_store_evicted_keys"
EVICTING_POLICY_GAUGE = "tooleffect_store_maxmemory_policy_evicting"
DURABILITY_GAUGE = "tooleffect_store_durability"
REPLICAS_GAUGE = "tooleffect_store_replicas_in_sync"
USED_MEMORY_GAUGE = "tooleffect_store_used_memory_bytes"
MAXMEMORY_GAUGE = "tooleffect_store_maxmemory_bytes"
PROJECTED_MEMORY_GAUGE = "tooleffect_store_projected_memory_bytes"
BYTES_PER_CALL_GAUGE = "tooleffect_store_bytes_per_call"
CALL_RATE_GAUGE = "tooleffect_store_calls_per_second"
KEYS_GAUGE = "tooleffect_store_keys"
#: Seconds a sizing is served before it is measured again, and its bounds: a
#: scrape costs at most one sizing read of the store per this many seconds.
SIZING_TTL = 60.0
SIZING_SAMPLE, SIZING_RUNS, SIZING_WINDOW = 2_000, 50, 500


class StoreGauges:
    """A prometheus_client collector of the store's gauges, read at each scrape.

    - ``tooleffect_approvals_pending{queue,tool}``: from ``Approvals(app).stats()``
      (which, as every read of the approvals, also expires the calls nobody
      decided in time);
    - ``tooleffect_dead_letters{queue,reason,failure_class,effect}``: the joint
      counts, one ``HGETALL`` (:meth:`DeadLetters.counts`);
    - ``tooleffect_oldest_dead_letter_age_seconds{queue}``: now minus the
      oldest score of each queue's index, one pipelined ``ZREVRANGE -1 -1
      WITHSCORES`` per queue (:meth:`DeadLetters.oldest`);
    - ``tooleffect_store_evicted_keys{store}`` and
      ``tooleffect_store_maxmemory_policy_evicting{store}`` (1 when its
      ``maxmemory-policy`` is not ``noeviction``, whatever ``maxmemory``):
      one ``INFO`` per server, ``store`` being ``journal`` (the journal and
      audit store) or ``dead_letters`` (only with ``dead_letters``); a server
      playing both roles gives both samples (see
      :mod:`celery_tooleffect.store.servers`);
    - ``tooleffect_store_durability{store,mode}``: 1 for the persistence mode
      each role's server runs (``mode`` as in
      :class:`~celery_tooleffect.store.persistence.PersistenceMode`; a server
      whose persistence cannot be read has no sample), and
      ``tooleffect_store_replicas_in_sync``: the journal store's replicas in
      sync (``docs/redis.md#durability``);
    - the store's sizing (:func:`~celery_tooleffect.admin.sizing.measure_store`,
      ``docs/redis.md#sizing-the-store``): ``tooleffect_store_used_memory_bytes``,
      ``tooleffect_store_maxmemory_bytes`` (0: none set),
      ``tooleffect_store_projected_memory_bytes`` (at the current call rate
      for the retention), ``tooleffect_store_calls_per_second``,
      ``tooleffect_store_bytes_per_call{effect}`` and
      ``tooleffect_store_keys{kind}``; measured on a bounded sample at most
      once every :data:`SIZING_TTL` seconds, served from that between.

    No envelope is read. A label set with nothing in it has no sample. When a
    store does not answer, its gauges have no sample at all (absent, never a
    false 0) and a warning is logged; the other gauges, and the rest of
    ``/metrics``, are served all the same.
    """

    def __init__(self, approvals: Approvals, dead_letters: DeadLetters | None = None,
                 sizing_ttl: float = SIZING_TTL) -> None:
        self.approvals = approvals
        self.dead_letters = dead_letters
        self.sizing_ttl = sizing_ttl
        self._sizing: tuple[float, Sizing] | None = None

    def families(self) -> list[GaugeMetricFamily]:
        """Empty families of the gauges, in the order they are served."""
        found = [GaugeMetricFamily(
            APPROVALS_GAUGE, "Tool calls awaiting a person's approval (celery-tooleffect).",
            labels=["queue", "tool"],
        )]
        if self.dead_letters is not None:
            found += [
                GaugeMetricFamily(
                    DEAD_LETTERS_GAUGE,
                    "Dead letters by queue, dead-letter reason, failure class and effect "
                    "(celery-tooleffect).",
                    labels=["queue", "reason", "failure_class", "effect"],
                ),
                GaugeMetricFamily(
                    OLDEST_DEAD_LETTER_GAUGE,
                    "Seconds since the oldest dead letter of the queue was stored "
                    "(celery-tooleffect).",
                    labels=["queue"],
                ),
            ]
        found += [
            GaugeMetricFamily(
                EVICTED_KEYS_GAUGE,
                "Keys the store's Redis has evicted (INFO evicted_keys; celery-tooleffect).",
                labels=["store"],
            ),
            GaugeMetricFamily(
                EVICTING_POLICY_GAUGE,
                "1 when the store's maxmemory-policy can evict the package's keys "
                "(celery-tooleffect).",
                labels=["store"],
            ),
            GaugeMetricFamily(
                DURABILITY_GAUGE,
                "1 for the persistence mode of the store's Redis: aof_always, aof_everysec, "
                "aof_no, aof, rdb, none (celery-tooleffect).",
                labels=["store", "mode"],
            ),
            GaugeMetricFamily(
                REPLICAS_GAUGE,
                "Replicas of the journal store in sync (INFO replication; celery-tooleffect).",
            ),
        ]
        found += self.sizing_families()
        return found

    def sizing_families(self) -> list[GaugeMetricFamily]:
        """Empty families of the sizing gauges."""
        return [
            GaugeMetricFamily(USED_MEMORY_GAUGE,
                              "The store's used memory (INFO used_memory; celery-tooleffect)."),
            GaugeMetricFamily(MAXMEMORY_GAUGE,
                              "The store's maxmemory, 0 when none (celery-tooleffect)."),
            GaugeMetricFamily(
                PROJECTED_MEMORY_GAUGE,
                "The store's memory projected at the current call rate for the retention "
                "(celery-tooleffect)."),
            GaugeMetricFamily(
                CALL_RATE_GAUGE,
                "Tool calls per second, read from the global audit stream (celery-tooleffect)."),
            GaugeMetricFamily(
                BYTES_PER_CALL_GAUGE,
                "Bytes a call leaves in the store, by effect, measured on sampled runs "
                "(celery-tooleffect).", labels=["effect"]),
            GaugeMetricFamily(
                KEYS_GAUGE, "The store's keys by kind, extrapolated from a sample "
                "(celery-tooleffect).", labels=["kind"]),
        ]

    def describe(self) -> list[Metric]:
        # Their names, without a scrape's Redis reads (registering calls this).
        return list(self.families())

    def collect(self) -> Iterator[Metric]:
        families = self.families()[:-len(self.sizing_families())]
        yield from self.evictions(*families[-4:-2])
        yield from self.durability(*families[-2:])
        yield from self.sizing()
        approvals = families[0]
        stats = _served(APPROVALS_GAUGE, self.approvals.stats)
        if stats is not None:
            for row in stats["by_queue_and_tool"]:
                approvals.add_metric([row["queue"], row["tool"]], row["pending"])
            yield approvals
        if self.dead_letters is None:
            return
        letters, oldest = families[1], families[2]
        counts = _served(DEAD_LETTERS_GAUGE, self.dead_letters.counts)
        if counts is not None:
            for count in counts:
                letters.add_metric(
                    [count.queue, count.reason, count.failure_class, count.effect], count.count
                )
            yield letters
        stored = _served(OLDEST_DEAD_LETTER_GAUGE, self.dead_letters.oldest)
        if stored is not None:
            now = time.time()
            for queue, stored_at in sorted(stored.items()):
                oldest.add_metric([queue], max(now - stored_at, 0.0))
            yield oldest

    def evictions(self, evicted: GaugeMetricFamily,
                  evicting: GaugeMetricFamily) -> Iterator[Metric]:
        """The eviction gauges of the roles whose servers answered."""
        letters = self.dead_letters.client if self.dead_letters is not None else None
        found = _served(EVICTED_KEYS_GAUGE, lambda: role_readings(
            servers_of(self.approvals.runtime.audit.client, letters)))
        if found is None:
            return
        readings, failed = found
        for role, exc in sorted(failed.items()):
            logger.warning("%s{store=%s} not served: %s: %s", EVICTED_KEYS_GAUGE, role,
                           type(exc).__name__, exc)
        for role, reading in sorted(readings.items()):
            evicted.add_metric([role], reading.evicted_keys)
            evicting.add_metric([role], 1.0 if reading.evicting else 0.0)
        if readings:
            yield evicted
            yield evicting

    def durability(self, modes: GaugeMetricFamily,
                   replicas: GaugeMetricFamily) -> Iterator[Metric]:
        """The persistence mode of each role's server, and the store's replicas."""
        letters = self.dead_letters.client if self.dead_letters is not None else None
        found = _served(DURABILITY_GAUGE, functools.partial(
            servers_of, self.approvals.runtime.audit.client, letters)) or []
        for server in found:
            persistence = _served(DURABILITY_GAUGE,
                                  functools.partial(read_persistence, server.client))
            if persistence is not None:
                for role in server.roles:
                    modes.add_metric([role, persistence.mode.value], 1.0)
        in_sync = _served(REPLICAS_GAUGE, lambda: sum(
            online_replicas(server.client) for server in found if JOURNAL in server.roles))
        if in_sync is not None:
            replicas.add_metric([], float(in_sync))
            yield replicas
        yield modes

    def sizing(self) -> Iterator[Metric]:
        """The sizing gauges, from a sizing at most :attr:`sizing_ttl` seconds old."""
        now = time.monotonic()
        if self._sizing is None or now - self._sizing[0] >= self.sizing_ttl:
            measured = _served(USED_MEMORY_GAUGE, lambda: measure_store(
                self.approvals.app, self.approvals.runtime, sample=SIZING_SAMPLE,
                runs=SIZING_RUNS, window=SIZING_WINDOW))
            if measured is None:
                self._sizing = None
                return
            self._sizing = (now, measured)
        sizing = self._sizing[1]
        used, limit, projected, rate, per_call, keys = self.sizing_families()
        used.add_metric([], float(sizing.used_memory))
        limit.add_metric([], float(sizing.maxmemory))
        projected.add_metric([], float(sizing.projected_memory))
        rate.add_metric([], sizing.calls_per_second)
        for effect, size in sorted(sizing.effects.items()):
            per_call.add_metric([effect], float(size.bytes_per_call))
        for kind, counted in sizing.kinds.items():
            if counted.keys:
                keys.add_metric([kind], float(counted.keys))
        yield from (used, limit, projected, rate, per_call, keys)


def _served(gauge: str, read: Callable[[], T]) -> T | None:
    """``read()``, or None (and a warning) when the store does not answer."""
    try:
        return read()
    except Exception as exc:  # the rest of /metrics is served all the same
        logger.warning("%s not served: %s: %s", gauge, type(exc).__name__, exc)
        return None


#: The collector each registry serves (a second Flower app in a process replaces the first's).
_gauges: weakref.WeakKeyDictionary[CollectorRegistry, StoreGauges] = (
    weakref.WeakKeyDictionary())


def export_store_gauges(
    approvals: Approvals, dead_letters: DeadLetters | None = None,
    registry: CollectorRegistry = prometheus_client.REGISTRY,
) -> StoreGauges:
    """Serve the store's gauges (:class:`StoreGauges`) from ``registry``: by default
    prometheus_client's own, the one Flower's ``/metrics`` writes out."""
    gauges = StoreGauges(approvals, dead_letters)
    previous = _gauges.pop(registry, None)
    if previous is not None:
        registry.unregister(previous)
    registry.register(gauges)
    _gauges[registry] = gauges
    return gauges
