"""The tool-call phases: throughput, latency and Redis round trips per call.

Every variant (``bench.app.VARIANTS``) runs on the ``celery worker`` processes
of its fetch (``bench.app.FETCH``: the baseline on workers with kombu's own
fetch, every other variant on workers with the package's atomic fetch; both
kinds run all along), in rounds interleaved A B C D E F A B C D E F ..., so
that what the machine does meanwhile falls on all of them alike.

- **Throughput**: a round publishes N calls to a queue of its own that no
  worker consumes yet, then tells the workers to consume it
  (``control.add_consumer``) and waits until every result is stored. Its rate
  is ``(N - 1) / (last date_done - first date_done)``: the worker's own
  timestamps of the final states, so publishing and polling do not count.
- **Latency**: one call at a time; each is the time from just before its
  publish to its ``date_done`` (the moment the worker recorded its final
  state), so it holds everything the package adds to one call and no queueing.
- **Round trips**: the workers reach Redis through one counting proxy per role
  (broker, result backend, the package's store). Two batches of different
  sizes run the same way; the per-call figure is the difference of their
  counts divided by the difference of their sizes, so fixed costs (the control
  messages that start and stop a batch) cancel out; a first batch warms the
  pool processes up (connections, scripts) and is not counted. Redis commands
  (``INFO commandstats``, commands run inside scripts included) are counted the
  same way, less the benchmark's own polling.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis
from celery import Celery

from celery_tooleffect.testing import WorkerProcess

from .app import FETCH, VARIANTS, config, latency_queue
from .servers import redis_cpu_seconds


@dataclass
class Round:
    """One throughput round of one variant."""

    variant: str
    calls: int
    seconds: float
    #: CPU microseconds per call: workers' main processes, pool processes, redis-server.
    cpu_us: dict[str, float] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return (self.calls - 1) / self.seconds


@dataclass
class VariantFigures:
    """What the phases measured for one variant."""

    variant: str
    rounds: list[Round] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    round_trips: dict[str, float] = field(default_factory=dict)
    commands: dict[str, float] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Median calls per second over the rounds."""
        return statistics.median(round_.per_second for round_ in self.rounds)

    def cpu_us(self, part: str) -> float:
        """Median CPU microseconds per call spent by ``part`` over the rounds."""
        return statistics.median(round_.cpu_us[part] for round_ in self.rounds)

    def latency(self, percentile: float) -> float:
        ordered = sorted(self.latencies_ms)
        index = min(len(ordered) - 1, max(0, round(percentile / 100 * len(ordered)) - 1))
        return ordered[index]


class CountingClient:
    """A Redis client whose commands the benchmark counts, to subtract its own polling."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.sent: Counter[str] = Counter()

    def llen(self, key: str) -> int:
        self.sent["llen"] += 1
        return int(self.client.llen(key))

    def mget(self, keys: Sequence[str]) -> list[Any]:
        self.sent["mget"] += 1
        return list(self.client.mget(keys))


def producer_app(prefix: str, url: str, *, with_results: bool) -> Celery:
    """An app that publishes the calls. Without results it subscribes to nothing,
    so a throughput round's producer costs Redis one LPUSH a call."""
    app = Celery(f"bench-producer-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(config(prefix, url))
    if not with_results:
        app.conf.result_backend = None
    return app


def publish(app: Celery, task_name: str, queue: str, calls: int) -> list[str]:
    """Publish ``calls`` calls of ``task_name`` to ``queue``; their task ids."""
    ids = []
    with app.producer_or_acquire() as producer:
        for number in range(calls):
            ids.append(app.send_task(task_name, args=[number], queue=queue,
                                     producer=producer).id)
    return ids


def consume(app: Celery, worker_names: list[str], queue: str, ids: list[str], prefix: str,
            poller: CountingClient, timeout: float) -> list[dict[str, Any]]:
    """Let the workers consume ``queue`` until every call in ``ids`` has its result.

    Returns the stored results; raises if a call did not end in SUCCESS.
    """
    replies = app.control.add_consumer(queue, destination=worker_names, reply=True,
                                       timeout=5)
    if len(replies or []) != len(worker_names):
        raise RuntimeError(f"not every worker consumes {queue}: {replies}")
    deadline = time.monotonic() + timeout
    try:
        while poller.llen(f"{prefix}{queue}") > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{queue} not drained in {timeout:g}s")
            time.sleep(0.05)
        keys = [f"{prefix}celery-task-meta-{task_id}" for task_id in ids]
        while True:
            stored = [value for chunk in _chunks(keys, 5000) for value in poller.mget(chunk)]
            if all(value is not None for value in stored):
                break
            if time.monotonic() > deadline:
                missing = sum(value is None for value in stored)
                raise TimeoutError(f"{missing} results of {queue} missing after {timeout:g}s")
            time.sleep(0.02)
    finally:
        app.control.cancel_consumer(queue, destination=worker_names, reply=True, timeout=5)
    results = [json.loads(value) for value in stored if value is not None]
    failed = [result for result in results if result.get("status") != "SUCCESS"]
    if failed:
        raise RuntimeError(f"{len(failed)} calls of {queue} did not succeed: {failed[:3]}")
    return results


def _chunks(items: Sequence[str], size: int) -> list[Sequence[str]]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def _done_at(result: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(result["date_done"])).timestamp()


def cpu_seconds(started: Sequence[WorkerProcess], server: redis.Redis) -> dict[str, float]:
    """CPU seconds spent so far, by part."""
    main = pool = 0.0
    for worker in started:
        worker_main, worker_pool = worker.cpu_seconds()
        main, pool = main + worker_main, pool + worker_pool
    return {"worker main": main, "pool": pool, "redis": redis_cpu_seconds(server)}


def throughput_rounds(app: Celery, groups: Mapping[str, Sequence[WorkerProcess]],
                      prefix: str, poller: CountingClient,
                      figures: dict[str, VariantFigures], *, rounds: int, calls: int,
                      warmup: int, progress: Callable[[str], None]) -> None:
    """Interleaved throughput rounds (after one discarded warm-up round each).

    ``groups``: the running workers of each fetch; a variant's round is run,
    and its CPU counted, on the workers of its fetch (``bench.app.FETCH``)."""
    for number in range(-1 if warmup else 0, rounds):
        for variant, task_name in VARIANTS.items():
            started = groups[FETCH[variant]]
            worker_names = [worker.name for worker in started]
            size = warmup if number < 0 else calls
            queue = f"bench-tp-{uuid.uuid4().hex[:8]}"
            ids = publish(app, task_name, queue, size)
            before = cpu_seconds(started, poller.client)
            results = consume(app, worker_names, queue, ids, prefix, poller,
                              timeout=60 + size / 20)
            after = cpu_seconds(started, poller.client)
            done = sorted(_done_at(result) for result in results)
            if number < 0:
                continue
            measured = Round(variant, size, max(done[-1] - done[0], 1e-6), {
                part: (after[part] - before[part]) * 1e6 / size for part in after})
            figures[variant].rounds.append(measured)
            progress(f"throughput round {number + 1}/{rounds} {variant}: "
                     f"{measured.per_second:,.0f} calls/s; CPU per call "
                     + ", ".join(f"{part} {value:.0f} us"
                                 for part, value in measured.cpu_us.items()))


def latency_rounds(app: Celery, figures: dict[str, VariantFigures], *, rounds: int,
                   calls: int, progress: Callable[[str], None]) -> None:
    """Interleaved rounds of one call at a time; latency = publish to date_done.

    Each call goes to the latency queue of its variant's fetch (its workers')."""
    for number in range(rounds):
        for variant, task_name in VARIANTS.items():
            queue = latency_queue(FETCH[variant])
            taken = []
            for call in range(calls + 5):
                started = time.time()
                result = app.send_task(task_name, args=[call], queue=queue)
                if result.get(timeout=30) != call:
                    raise RuntimeError(f"{task_name} answered wrongly")
                done_at = result.date_done.timestamp()
                result.forget()
                if call >= 5:  # the first few after a switch warm the child's caches
                    taken.append((done_at - started) * 1000.0)
            figures[variant].latencies_ms.extend(taken)
            progress(f"latency round {number + 1}/{rounds} {variant}: "
                     f"p50 {statistics.median(taken):.2f} ms")


#: The role under which the one-Redis run's round trips are kept.
ONE_REDIS = "one redis"


@dataclass
class Snapshot:
    """Round trips per role and Redis commands by name, at one moment."""

    round_trips: dict[str, int]
    commands: Counter[str]


def snapshot(proxies: dict[str, Any], server: redis.Redis, poller: CountingClient) -> Snapshot:
    stats: dict[str, Any] = server.info("commandstats")
    commands: Counter[str] = Counter()
    for name, entry in stats.items():
        command = name.removeprefix("cmdstat_")
        if command not in ("info", "config|resetstat"):
            commands[command] = int(entry["calls"])
    commands.subtract(poller.sent)  # the benchmark's own polling
    return Snapshot({role: proxy.round_trips for role, proxy in proxies.items()}, commands)


def round_trip_counts(app: Celery, worker_names: list[str], prefix: str,
                      poller: CountingClient, server: redis.Redis, proxies: dict[str, Any],
                      figures: dict[str, VariantFigures], *, small: int, large: int,
                      progress: Callable[[str], None], one_redis: bool = False,
                      variants: Mapping[str, str] | None = None) -> None:
    """Round trips and commands per call, from two batches of different sizes,
    of each of ``variants`` (variant: task name; default: every variant).

    Only the workers that run the variants may be connected through the
    proxies meanwhile (another worker's idle polling would be counted).

    ``one_redis``: broker, result backend and store are one Redis behind one
    proxy (the package then stores results, broker leases and the
    acknowledgement of a successful call in its own scripts); its figure is
    kept as the round trips of role ``one redis``, beside those of the
    per-role run."""
    for variant, task_name in (VARIANTS if variants is None else variants).items():
        spent: list[tuple[dict[str, int], Counter[str]]] = []
        # A first batch is discarded: connecting, loading scripts and the
        # like happen once per pool process and would not cancel out.
        for size in (small, small, large):
            queue = f"bench-rt-{uuid.uuid4().hex[:8]}"
            ids = publish(app, task_name, queue, size)
            before = snapshot(proxies, server, poller)
            consume(app, worker_names, queue, ids, prefix, poller, timeout=120)
            after = snapshot(proxies, server, poller)
            trips = {role: after.round_trips[role] - before.round_trips[role]
                     for role in proxies}
            commands = Counter(after.commands)
            commands.subtract(before.commands)
            spent.append((trips, commands))
        (small_trips, small_commands), (large_trips, large_commands) = spent[1:]
        calls = large - small
        counted = {role: (large_trips[role] - small_trips[role]) / calls for role in proxies}
        if one_redis:
            figures[variant].round_trips[ONE_REDIS] = sum(counted.values())
            progress(f"round trips {variant}, one Redis: {sum(counted.values()):.2f}")
            continue
        figures[variant].round_trips.update(counted)
        per_command = Counter(large_commands)
        per_command.subtract(small_commands)
        figures[variant].commands = {
            name: count / calls for name, count in sorted(per_command.items())
            if abs(count / calls) >= 0.05
        }
        progress(f"round trips {variant}: "
                 + ", ".join(f"{role} {value:.2f}" for role, value in counted.items()))
