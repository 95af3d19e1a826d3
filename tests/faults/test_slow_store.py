"""The audit store answers slowly: later than ``tooleffect_socket_timeout``.

The proxy (``tests.support.TcpProxy``) delays every chunk by 1 s, both ways,
between a ``celery worker`` (prefork, ``tooleffect_socket_timeout`` 0.5 s) and
the audit store. A command the worker gave up on still reaches the server and
is applied there, after the worker has decided what its silence means: every
timeout is an ambiguous outcome.

- **slow before the intent**: no write may run while the intent goes
  unanswered. The server does record those intents later, under tokens no
  worker holds any more; once their lease lapses, an IDEMPOTENT_WRITE is
  reclaimed and runs once, and a NON_IDEMPOTENT_WRITE is dead-lettered
  ``interrupted_write`` without having run (the journal cannot tell an intent
  whose answer was lost from a worker that died after it; it fails closed);
- **slow between intent and outcome**: the outcome times out, so every write
  fails closed (dead letter ``not_retryable``, ``AuditPersistenceFailed``,
  ``body_completed``). The server applies the outcome later anyway: the
  journal then says ``succeeded`` beside the dead letter, which is the truth
  (the body ran once) and keeps the write from running again.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_tooleffect.admin.operations import DeadLetterOperations, Outcome
from celery_tooleffect.testing import RedisServer, WorkerProcess, wait_for
from tests.faults.scenario import FaultRun, broker_holds, load_scripts
from tests.support import TcpProxy

pytestmark = pytest.mark.timeout(180)

LATENCY = 1.0
SOCKET_TIMEOUT = "0.5"
VT = 6.0


def test_slow_before_the_intent_no_write_runs_without_its_intent(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    run = FaultRun("store answers slowly (1 s > 0.5 s timeout) before the intent",
                   make_app(tooleffect_redis_url=second_redis.url), main_redis, prefix)
    load_scripts(second_redis.client())
    with TcpProxy(second_redis.port, lifetime=170) as proxy:
        worker = spawn_worker(concurrency=9, visibility_timeout=VT, store_url=proxy.url(),
                              TE_SOCKET_TIMEOUT=SOCKET_TIMEOUT, TE_MAX_RETRIES="40")
        # Every pool process connects to the store first, so that the intents
        # go out on open connections and reach the server after the timeout.
        warm_up = FaultRun("warm-up", run.app, main_redis, prefix)
        warm_up.submit_mix(hold=0.5)
        wait_for(lambda: all(warm_up.state(call) == "SUCCESS" for call in warm_up.calls),
                 timeout=30, what="the warm-up calls")
        proxy.latency = LATENCY
        run.faults += 1
        calls = run.submit_mix()
        writes = [call for call in calls if call.is_write]
        reads = [call for call in calls if not call.is_write]
        wait_for(lambda: all(run.state(call) == "RETRY" for call in writes), timeout=30,
                 what="every write to be retried for want of an intent")
        wait_for(lambda: all(run.state(call) == "SUCCESS" for call in reads), timeout=30,
                 what="the reads to succeed (their audit is fail-soft)")
        assert [run.runs(call) for call in writes] == [0] * len(writes)
        proxy.latency = 0.0
        run.settle(timeout=60)
    run.report()
    assert run.problems() == [], run.diagnose([worker.output()])
    for call in calls:
        letter = run.letter(call)
        if call.effect == "non_idempotent_write" and letter is not None:
            # Its intent was applied after the worker gave up on it: fail closed.
            assert run.runs(call) == 0, run.diagnose()
            assert letter.reason == "interrupted_write" and not letter.body_completed
        else:
            assert run.runs(call) == 1 and run.state(call) == "SUCCESS", run.diagnose()
            assert letter is None


def test_slow_between_intent_and_outcome_writes_fail_closed(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    run = FaultRun("store answers slowly (1 s > 0.5 s timeout) between intent and outcome",
                   make_app(tooleffect_redis_url=second_redis.url), main_redis, prefix)
    load_scripts(second_redis.client())
    with TcpProxy(second_redis.port, lifetime=170) as proxy:
        worker = spawn_worker(concurrency=9, visibility_timeout=VT, store_url=proxy.url(),
                              TE_SOCKET_TIMEOUT=SOCKET_TIMEOUT)
        calls = run.submit_mix(hold=60.0)
        wait_for(run.all_started, timeout=30, what="every body to be running")
        proxy.latency = LATENCY
        run.faults += 1
        run.release()
        writes = [call for call in calls if call.is_write]
        wait_for(lambda: all(run.state(call) == "FAILURE" for call in writes), timeout=60,
                 what="every write to fail")
        proxy.latency = 0.0
        run.settle(timeout=60)
        # The server applied the outcomes the worker gave up on: the journal
        # says succeeded, and a second delivery of the same call does not run.
        wait_for(lambda: all(run.journal(call).get("state") == "succeeded" for call in writes),
                 timeout=30, what="the outcomes applied late to be in the journal")
        for call in writes:
            run.deliver_again(call)
        wait_for(lambda: broker_holds(main_redis, prefix) == 0, timeout=30,
                 what="the second deliveries to be acknowledged")
        # Nor does an operator's forced replay run a non-idempotent one again.
        operations = DeadLetterOperations(run.app)
        for call in writes:
            if call.effect == "non_idempotent_write":
                replay = operations.replay(call.task_id, actor="fault-test", force=True,
                                           reason="does the journal refuse it?")
                assert replay.outcome is Outcome.REFUSED, replay
                assert "outcome was recorded" in replay.message, replay
    run.report()
    assert run.problems() == [], run.diagnose([worker.output()])
    for call in calls:
        assert run.runs(call) == 1
        letter = run.letter(call)
        if not call.is_write:
            assert letter is None and run.state(call) == "SUCCESS"
            continue
        assert letter is not None
        assert (letter.reason, letter.failure_class, letter.exception_type) == (
            "not_retryable", "unknown", "AuditPersistenceFailed")
        assert letter.body_completed is True
        assert run.state(call) == "FAILURE"
