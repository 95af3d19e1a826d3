"""Redis restarts while calls are in flight.

- **The broker's Redis crashes and restarts** (SIGKILL, then started again on
  the same port with the same directory; ``--appendonly yes --appendfsync
  always``). It is also the audit store (the default: no
  ``tooleffect_redis_url``), so journal, dead letters, queue, unacknowledged
  messages and results all go away together and come back from the AOF.
- **The audit store restarts without persistence**: a separate store with no
  AOF and no RDB snapshots is killed and started again empty: every journal
  entry is gone. The worker said so when it started.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_tooleffect.testing import WorkerProcess, redis_server, wait_for
from tests.faults.scenario import MIX, FaultRun

pytestmark = pytest.mark.timeout(240)

VT = 6.0


def not_persisting(port: int) -> str:
    """The start of the worker-start warning about a store that keeps nothing on
    disk (the suite's apps accept one: ``tooleffect_allow_volatile_store``)."""
    return ("celery-tooleffect: VOLATILE STORE ALLOWED (tooleffect_allow_volatile_store = "
            f"True): the journal and audit store (127.0.0.1:{port}) can lose acknowledged "
            "writes when its process restarts (no AOF and no RDB snapshots")


def test_broker_restarts_with_aof_while_calls_run(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str,
) -> None:
    rng = random.Random(7)
    with redis_server("--appendonly", "yes", "--appendfsync", "always") as broker:
        app = make_app(broker_url=broker.url, result_backend=broker.url)
        run = FaultRun("broker Redis restarts (AOF, also the store)", app, main_redis, prefix)
        worker = spawn_worker(concurrency=4, visibility_timeout=VT, broker_url=broker.url,
                              TE_MAX_RETRIES="10")
        assert not_persisting(broker.port) not in worker.output()
        for tool in MIX * 2:
            run.submit(tool, hold=rng.uniform(0.3, 1.5))
        for _ in range(2):
            wait_for(lambda: sum(run.runs(call) > 0 for call in run.calls) >= 4 * (run.faults + 1),
                     timeout=60, what="calls to be running")
            broker.restart(downtime=1.5)
            run.faults += 1
        run.settle(timeout=120)
        run.report()
        assert run.problems() == [], run.diagnose([worker.output()])
        assert worker.process.poll() is None, "the worker exited during the restarts"


def test_store_restarts_without_persistence_while_writes_run(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str,
) -> None:
    with redis_server() as store:
        run = FaultRun("audit store restarts empty (no persistence)",
                       make_app(tooleffect_redis_url=store.url), main_redis, prefix)
        run.journal_lost = True
        worker = spawn_worker(concurrency=9, visibility_timeout=VT, store_url=store.url)
        # The worker said so when it started.
        warned = [line for line in worker.output().splitlines()
                  if not_persisting(store.port) in line]
        assert warned and "a redelivered write would run again" in warned[0], worker.output()
        calls = run.submit_mix(hold=60.0)
        wait_for(run.all_started, timeout=30, what="every body to be running")
        store.restart(downtime=0.5)
        run.faults += 1
        assert store.client().dbsize() == 0
        started = time.monotonic()
        run.release()
        run.settle(timeout=60)
        run.report()
        print(f"settled in {time.monotonic() - started:.1f}s")
        assert run.problems() == [], run.diagnose([worker.output()])
        for call in calls:
            assert run.runs(call) == 1, run.diagnose([worker.output()])


def test_store_restarts_without_persistence_after_a_worker_died_mid_write(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str,
) -> None:
    """The case the start warning is about: a NON_IDEMPOTENT_WRITE runs twice.

    A worker dies (SIGKILL) in the middle of its bodies; with its journal the
    next delivery of a non-idempotent write would be dead-lettered
    ``interrupted_write``. The store then restarts empty: the journal that
    said "this write started" is gone, the messages come back after the
    visibility timeout, and every call runs again, non-idempotent writes
    included. Nothing in Redis remembers the first run, and the rollback watch
    (docs/redis.md#rollbacks) cannot see it either: the worker that counted
    the intents died with its counts, and the new one starts from nothing.
    Without ``tooleffect_allow_volatile_store`` such a store refuses the
    start; with it, the warning each worker gave at start said that this
    could happen.
    """
    with redis_server() as store:
        run = FaultRun("audit store restarts empty after a worker died mid-write",
                       make_app(tooleffect_redis_url=store.url), main_redis, prefix)
        run.journal_lost = True
        first = spawn_worker(concurrency=9, visibility_timeout=VT, store_url=store.url)
        calls = run.submit_mix(hold=60.0)
        wait_for(run.all_started, timeout=30, what="every body to be running")
        first.kill()
        store.restart(downtime=0.5)
        run.faults += 2
        second = spawn_worker(concurrency=9, visibility_timeout=VT, store_url=store.url)
        run.settle(timeout=90)
        summary = run.report()
        logs = [first.output(), second.output()]
        for log in logs:
            assert not_persisting(store.port) in log
        problems = [p for p in run.problems() if not p.endswith("ran 2 times")]
        assert problems == [], run.diagnose(logs)
        # The honest outcome: every call ran twice, the three non-idempotent
        # writes included (the README says so next to the warning).
        assert [run.runs(call) for call in calls] == [2] * len(calls), run.diagnose(logs)
        assert summary.duplicates == 3
