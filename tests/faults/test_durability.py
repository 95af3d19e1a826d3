"""A Redis that restarts from its own files while writes run (issue 37).

Each scenario starts a ``redis-server`` of its own in one persistence mode,
holding broker, results and store (or, on RabbitMQ, the store), sends 400
NON_IDEMPOTENT_WRITE calls to one prefork worker (concurrency 2), SIGKILLs
the server once about a third of the bodies ran, and starts it again on the
same port from the same folder. The worker reconnects by itself. Then every
call must end (a success or a dead letter), and no body may have run twice.

- **RDB snapshots only** (Redis's own default ``save`` lines; a snapshot is
  also taken once a sixth of the bodies ran, so that the restart comes back
  from an *older* file, not from nothing): the worker refuses to start on it,
  naming the mode; with ``tooleffect_allow_volatile_store`` it starts, and the
  rollback watch (:mod:`celery_tooleffect.store.rollback`) finds the store
  holding fewer intents than it acknowledged: the writes the store can no
  longer vouch for are dead letters ``store_rolled_back`` (or, for a tool with
  ``reconcile``, asked first), never run blind.
- **AOF everysec** and **AOF always**: a process kill loses nothing.
- **RabbitMQ with the store in the snapshot mode**: the broker is not rolled
  back with the store, so only messages it delivered before can have run.

The summary line of each goes to the session's report (``fault ...``), and
docs/redis.md#durability has the figures of one run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_tooleffect.testing import RedisServer, WorkerProcess, redis_server, wait_for
from tests.faults.scenario import FaultRun

pytestmark = pytest.mark.timeout(300)

CALLS = 400
#: Redis's own default ``save`` lines (redis.conf of Redis 7).
DEFAULT_SAVE = ("--save", "3600 1 300 100 60 10000")
MODES = {
    "rdb": DEFAULT_SAVE,
    "aof_everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
    "aof_always": ("--appendonly", "yes", "--appendfsync", "always"),
}
VT = 6.0


def bodies_ran(run: FaultRun) -> int:
    """How many bodies ran in all (one MGET of every call's counter)."""
    keys = [f"{run.prefix}count:{call.key}" for call in run.calls]
    return sum(int(value or 0) for value in run.counters.mget(keys))


def restart_mid_load(run: FaultRun, server: RedisServer, *, snapshot: bool) -> None:
    """Let about a third of the bodies run (taking a snapshot at a sixth when
    ``snapshot``), then SIGKILL the server and start it from its files."""
    if snapshot:
        wait_for(lambda: bodies_ran(run) >= CALLS // 6, timeout=120,
                 what="a sixth of the bodies to run", interval=0.01)
        server.client().save()
    wait_for(lambda: bodies_ran(run) >= CALLS // 3, timeout=120,
             what="a third of the bodies to run", interval=0.01)
    server.restart(downtime=1.0)
    run.faults += 1


def check(run: FaultRun, workers: list[WorkerProcess]) -> None:
    pending = run.settle(timeout=180)
    summary = run.report()
    logs = [worker.output() for worker in workers]
    tails = "\n".join(log[-6000:] for log in logs)
    assert not pending, f"{run.diagnose(logs)}\n--- the workers' last lines:\n{tails}"
    assert summary.duplicates == 0 and summary.lost == 0, run.diagnose(logs)
    assert run.problems() == [], run.diagnose(logs)
    assert all(worker.process.poll() is None for worker in workers), "a worker exited"


@pytest.mark.parametrize("mode", ["rdb", "none"])
def test_a_store_that_loses_writes_on_restart_refuses_the_start(
    mode: str, spawn_worker: Callable[..., WorkerProcess],
) -> None:
    args = DEFAULT_SAVE if mode == "rdb" else ()
    words = "RDB snapshots only, no AOF" if mode == "rdb" else "no AOF and no RDB snapshots"
    with redis_server(*args) as server, pytest.raises(AssertionError) as refused:
        spawn_worker(concurrency=2, broker_url=server.url, TE_VOLATILE="0")
    said = str(refused.value)
    assert (f"the journal and audit store and the dead-letter store (127.0.0.1:{server.port}) "
            "can lose acknowledged "
            f"writes when its process restarts ({words}, read by CONFIG GET)") in said, said
    assert "set appendonly yes" in said
    assert "tooleffect_allow_volatile_store = True to accept the risk" in said


def test_aof_everysec_starts_with_one_warning_about_machine_crashes(
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    with redis_server(*MODES["aof_everysec"]) as server:
        worker = spawn_worker(concurrency=1, broker_url=server.url, TE_VOLATILE="0")
        warned = [line for line in worker.output().splitlines()
                  if "a crash of its machine" in line]
        # One server plays both roles (store and dead letters): one line.
        assert len(warned) == 1, worker.output()
        assert "runs AOF, appendfsync everysec" in warned[0]
        assert ("set appendfsync always, or tooleffect_store_fsync = True (Redis 7.2 and "
                "later), or tooleffect_store_replicas") in warned[0]
        assert "see docs/operations.md#persistence" in warned[0]
    with redis_server(*MODES["aof_always"]) as server:
        worker = spawn_worker(concurrency=1, broker_url=server.url, TE_VOLATILE="0")
        assert "a crash of its machine" not in worker.output()
        assert "can lose acknowledged writes" not in worker.output()


@pytest.mark.parametrize("mode", ["rdb", "aof_everysec", "aof_always"])
def test_the_redis_of_broker_and_store_restarts_from_its_files_mid_load(
    mode: str, make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str,
) -> None:
    with redis_server(*MODES[mode]) as server:
        app = make_app(broker_url=server.url, result_backend=server.url)
        run = FaultRun(f"redis restarts from its files ({mode}, broker and store)", app,
                       main_redis, prefix)
        # A rollback loses audit records of the writes it forgot.
        run.journal_lost = mode == "rdb"
        worker = spawn_worker(concurrency=2, visibility_timeout=VT, broker_url=server.url,
                              TE_MAX_RETRIES="10")
        for _ in range(CALLS):
            run.submit("tools.write", hold=0.02)
        restart_mid_load(run, server, snapshot=mode == "rdb")
        check(run, [worker])
        letters = [letter for call in run.calls if (letter := run.letter(call)) is not None]
        reasons = {letter.reason for letter in letters}
        # A body that ended while the server was down could not record its
        # outcome: failed closed, saying the write ran.
        outage = [letter for letter in letters if letter.reason == "not_retryable"]
        assert all(letter.exception_type == "AuditPersistenceFailed" and letter.body_completed
                   for letter in outage), outage
        if mode == "rdb":
            output = worker.output()
            assert "holds fewer intents than it acknowledged to this process" in output
            # Every letter the rollback made says why: the store cannot vouch.
            assert "store_rolled_back" in reasons, reasons
            assert reasons <= {"store_rolled_back", "interrupted_write", "not_retryable"}, reasons
        else:
            assert "holds fewer intents" not in worker.output()
            assert "store_rolled_back" not in reasons, reasons


def test_a_rolled_back_store_asks_the_reconciler_first(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str,
) -> None:
    """The snapshot mode with a tool that reconciles (``tools.charge``, a provider
    stand-in deduplicating by idempotency key): a write the rollback forgot is
    settled by asking, not dead-lettered, and never charged twice."""
    with redis_server(*MODES["rdb"]) as server:
        app = make_app(broker_url=server.url, result_backend=server.url)
        run = FaultRun("redis restarts from a snapshot (reconciling writes)", app,
                       main_redis, prefix)
        run.journal_lost = True
        worker = spawn_worker(concurrency=2, visibility_timeout=VT, broker_url=server.url,
                              TE_MAX_RETRIES="10")
        for _ in range(CALLS // 2):
            run.submit("tools.charge", hold=0.02)
        restart_mid_load(run, server, snapshot=True)
        check(run, [worker])
        charges = [int(main_redis.get(f"{prefix}charges:{call.key}") or 0) for call in run.calls]
        assert charges == [1] * len(run.calls), "a charge was made twice, or never"
        reconciled = [call for call in run.calls
                      if int(main_redis.get(f"{prefix}reconciled:{call.key}") or 0)]
        assert reconciled, "the rollback was not noticed"
        # No letter for want of knowing: the tool was asked. A body that ended
        # while the server was down still fails closed (its outcome unstorable).
        letters = [letter for call in run.calls if (letter := run.letter(call)) is not None]
        assert all(letter.reason == "not_retryable" and letter.body_completed
                   and letter.exception_type == "AuditPersistenceFailed"
                   for letter in letters), letters


def test_the_store_restarts_from_a_snapshot_under_rabbitmq(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str, rabbitmq_url: str,
) -> None:
    with redis_server(*MODES["rdb"]) as store:
        app = make_app(broker_url=rabbitmq_url, tooleffect_redis_url=store.url)
        run = FaultRun("store restarts from a snapshot (rdb, RabbitMQ broker)", app,
                       main_redis, prefix)
        run.journal_lost = True
        worker = spawn_worker(concurrency=2, broker_url=rabbitmq_url, store_url=store.url,
                              TE_MAX_RETRIES="10")
        for _ in range(CALLS):
            run.submit("tools.write", hold=0.02)
        restart_mid_load(run, store, snapshot=True)
        check(run, [worker])
