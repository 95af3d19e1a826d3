"""The audit store's connections are cut while scripts are in flight.

A TCP proxy of the test's own (``tests.support.TcpProxy``) sits between a
``celery worker`` (prefork) and the audit store. A cut script is an ambiguous
outcome for the worker: the server may have applied it and the answer was
lost, or it never arrived. Two kinds of cut:

- **random**: every connection is dropped at random moments while calls of
  each effect run, with a little latency on every answer so that scripts are
  in flight when the cut comes;
- **targeted**: the connection carrying a given journal script is cut, either
  after the server applied it (its answer is lost) or before it arrives: the
  intent (``begin_attempt``) and the success outcome (``transition`` to
  ``succeeded``) of every write.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_tooleffect.store.lua import script
from celery_tooleffect.testing import RedisServer, WorkerProcess, wait_for
from tests.faults.scenario import Call, FaultRun, load_scripts
from tests.support import TcpProxy

pytestmark = pytest.mark.timeout(180)

#: Visibility timeout of the workers here: a write without a deadline is
#: leased for it, so an attempt whose owner vanished is noticed this soon.
VT = 6.0


def test_random_cuts_while_calls_run_lose_nothing_and_never_run_a_write_twice(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    rng = random.Random(20261202)
    run = FaultRun("store connection cut mid-script (random cuts)",
                   make_app(tooleffect_redis_url=second_redis.url), main_redis, prefix)
    with TcpProxy(second_redis.port, lifetime=170) as proxy:
        proxy.latency = 0.03  # every chunk waits a little: a cut catches scripts in flight
        worker = spawn_worker(concurrency=4, visibility_timeout=VT, store_url=proxy.url(),
                              TE_MAX_RETRIES="8")
        for _ in range(3):
            run.submit_mix(hold=0.0)
            run.submit_mix(hold=0.3)
        started = time.monotonic()
        while run.pending() and run.faults < 30 and time.monotonic() - started < 45:
            time.sleep(rng.uniform(0.3, 1.0))  # the pacing of the faults, not an assertion
            if proxy.cut():
                run.faults += 1
        proxy.latency = 0.0
        run.settle(timeout=60)
    run.report()
    assert run.problems() == [], run.diagnose([worker.output()])
    assert run.faults >= 5


# -- targeted cuts ------------------------------------------------------------------

WRITES = ["tools.idempotent"] * 3 + ["tools.write", "tools.write", "tools.write_deadline"]
BEGIN = script("begin_attempt").sha.encode()
TRANSITION = script("transition").sha.encode()


def targeted(
    name: str, parts: tuple[bytes, ...], applied: bool,
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    store: RedisServer, main: redis.Redis, prefix: str,
) -> tuple[FaultRun, WorkerProcess]:
    """Run the six writes (and three reads) with the given script's connection cut."""
    run = FaultRun(f"store connection cut mid-script ({name})",
                   make_app(tooleffect_redis_url=store.url), main, prefix)
    load_scripts(store.client())  # a cut EVALSHA is then the script, never NOSCRIPT
    with TcpProxy(store.port, lifetime=170) as proxy:
        worker = spawn_worker(concurrency=3, visibility_timeout=VT, store_url=proxy.url())
        # One cut per write: the first time its script goes out, never again.
        ids = [uuid.uuid4().hex for _ in WRITES]
        triggers = [proxy.cut_on(*parts, task_id.encode(), applied=applied, times=1)
                    for task_id in ids]
        for tool, task_id in zip(WRITES, ids, strict=True):
            run.submit(tool, task_id=task_id)
        for _ in range(3):
            run.submit("tools.read")
        wait_for(lambda: all(trigger.remaining == 0 for trigger in triggers), timeout=30,
                 what="every cut to be made")
        run.faults = sum(trigger.hits for trigger in triggers)
        run.settle(timeout=60)
    run.report()
    return run, worker


def phases(run: FaultRun, call: Call) -> list[str]:
    return [event["phase"] for event in run.events(call)]


def assert_each_ran_once_and_succeeded(run: FaultRun) -> None:
    for call in run.calls:
        assert run.runs(call) == 1 and run.state(call) == "SUCCESS", run.diagnose()
        assert run.letter(call) is None
        if call.is_write:
            # No trace of the cut in the audit trail: no late outcome, no retry.
            assert phases(run, call) == ["intent", "outcome"], phases(run, call)


def test_intent_applied_and_its_answer_lost(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    """The intent is sent again under the same token and recognised as its own."""
    run, worker = targeted("intent applied, answer lost", (BEGIN,), True,
                           make_app, spawn_worker, second_redis, main_redis, prefix)
    assert run.problems() == [], run.diagnose([worker.output()])
    assert_each_ran_once_and_succeeded(run)


def test_intent_never_arrives(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    run, worker = targeted("intent never arrives", (BEGIN,), False,
                           make_app, spawn_worker, second_redis, main_redis, prefix)
    assert run.problems() == [], run.diagnose([worker.output()])
    assert_each_ran_once_and_succeeded(run)


def test_outcome_applied_and_its_answer_lost(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    """The journal looks whether the transition it sent is there: it is, so it succeeded."""
    run, worker = targeted("outcome applied, answer lost", (TRANSITION, b"succeeded"), True,
                           make_app, spawn_worker, second_redis, main_redis, prefix)
    assert run.problems() == [], run.diagnose([worker.output()])
    assert_each_ran_once_and_succeeded(run)


def test_outcome_never_arrives_fails_closed(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    run, worker = targeted("outcome never arrives", (TRANSITION, b"succeeded"), False,
                           make_app, spawn_worker, second_redis, main_redis, prefix)
    assert run.problems() == [], run.diagnose([worker.output()])
    for call in run.calls:
        assert run.runs(call) == 1
        letter = run.letter(call)
        if not call.is_write:
            assert letter is None and run.state(call) == "SUCCESS"
            continue
        assert letter is not None and letter.body_completed, run.diagnose()
        assert (letter.reason, letter.exception_type) == ("not_retryable",
                                                          "AuditPersistenceFailed")
        assert run.state(call) == "FAILURE"
        assert run.journal(call)["state"] == "dead_lettered"
        assert phases(run, call) == ["intent", "outcome", "dead_lettered"], phases(run, call)
