"""The audit store refuses writes: out of memory, an ACL user without write
commands, a master demoted to a read-only replica.

Each refusal is made real on a redis-server of the test's own (the audit store,
``tooleffect_redis_url``) and struck at three moments of the calls of a
``celery worker`` (prefork, 9 processes), three calls of each effect:

- **before the intent**: writes must not run; they are retried as
  ``connection`` and run once when the store accepts writes again; reads run
  (their audit is fail-soft);
- **between intent and outcome**: every body is running (its intent
  recorded) when the store starts refusing; writes fail closed (dead letter
  ``not_retryable``, ``AuditPersistenceFailed``, ``body_completed``), reads
  succeed;
- **after the outcome**: every call succeeded; then the store refuses and
  each call is delivered again. A duplicate must neither run a write again nor
  change how the call ended: writes are acknowledged without running (their
  journal, which can still be read, says ``succeeded``), reads run again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis
from celery import Celery

from celery_tooleffect.testing import RedisServer, WorkerProcess, wait_for
from tests.faults.scenario import FaultRun, broker_holds, closed_port

pytestmark = pytest.mark.timeout(150)


@dataclass
class Refusal:
    """One way of making the store refuse writes; reads keep working."""

    mode: str
    store: RedisServer
    worker_url: str
    #: The error code the server answers a refused write with.
    code: str

    def refuse(self) -> None:
        admin = self.store.client()
        if self.mode == "oom":
            self.store.refuse_writes()
        elif self.mode == "acl":
            admin.execute_command("ACL", "SETUSER", "tooleffect", "reset", "on", ">pw", "~*",
                                  "&*", "+@all", "-@write")
        else:
            assert self._master_port is not None
            admin.execute_command("REPLICAOF", "127.0.0.1", str(self._master_port))

    def accept(self) -> None:
        admin = self.store.client()
        if self.mode == "oom":
            self.store.accept_writes()
        elif self.mode == "acl":
            admin.execute_command("ACL", "SETUSER", "tooleffect", "reset", "on", ">pw", "~*",
                                  "&*", "+@all")
        else:
            admin.execute_command("REPLICAOF", "NO", "ONE")

    def refused_commands(self) -> int:
        """How many commands the server refused with this fault's error code."""
        stats = self.store.client().info("errorstats")
        return int(stats.get(f"errorstat_{self.code}", {}).get("count", 0))

    _master_port: int | None = None


@contextlib.contextmanager
def refusal(mode: str, store: RedisServer) -> Iterator[Refusal]:
    if mode == "oom":
        yield Refusal(mode, store, store.url, "OOM")
    elif mode == "acl":
        fault = Refusal(mode, store, f"redis://tooleffect:pw@127.0.0.1:{store.port}/0", "NOPERM")
        fault.accept()  # the worker's user, with every command for now
        yield fault
    else:
        # A replica of a master that cannot be reached keeps its data, serves
        # reads and refuses writes (READONLY), as a demoted master does.
        with closed_port() as port:
            fault = Refusal(mode, store, store.url, "READONLY")
            fault._master_port = port
            yield fault


def fault_run(make_app: Callable[..., Celery], main: redis.Redis, prefix: str,
              store: RedisServer, scenario: str) -> FaultRun:
    reader = make_app(tooleffect_redis_url=store.url)
    return FaultRun(scenario, reader, main, prefix)


MODES = ["oom", "acl", "replica"]


@pytest.mark.parametrize("mode", MODES)
def test_refused_before_the_intent_writes_do_not_run_until_the_store_accepts(
    mode: str, make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    with refusal(mode, second_redis) as fault:
        run = fault_run(make_app, main_redis, prefix, second_redis,
                        f"store refuses writes ({mode}) before the intent")
        worker = spawn_worker(concurrency=9, store_url=fault.worker_url, TE_MAX_RETRIES="60")
        refused_before = fault.refused_commands()
        fault.refuse()
        run.faults += 1
        calls = run.submit_mix()
        writes = [call for call in calls if call.is_write]
        reads = [call for call in calls if not call.is_write]
        wait_for(lambda: all(run.state(call) == "RETRY" for call in writes), timeout=30,
                 what="every write to be refused its intent and retried")
        wait_for(lambda: all(run.state(call) == "SUCCESS" for call in reads), timeout=30,
                 what="the reads to succeed (their audit is fail-soft)")
        assert [run.runs(call) for call in writes] == [0] * len(writes)
        assert fault.refused_commands() > refused_before
        fault.accept()
        run.settle()
    run.report()
    assert run.problems() == [], run.diagnose([worker.output()])
    assert [run.runs(call) for call in calls] == [1] * len(calls)
    for call in writes:
        phases = [event["phase"] for event in run.events(call)]
        assert phases.count("intent") == 1 and phases[-1] == "outcome", phases
        assert run.journal(call)["state"] == "succeeded"


@pytest.mark.parametrize("mode", MODES)
def test_refused_between_intent_and_outcome_writes_fail_closed(
    mode: str, make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    with refusal(mode, second_redis) as fault:
        run = fault_run(make_app, main_redis, prefix, second_redis,
                        f"store refuses writes ({mode}) between intent and outcome")
        worker = spawn_worker(concurrency=9, store_url=fault.worker_url)
        calls = run.submit_mix(hold=60.0)
        wait_for(run.all_started, timeout=30, what="every body to be running")
        refused_before = fault.refused_commands()
        fault.refuse()
        run.faults += 1
        run.release()
        run.settle()
        assert fault.refused_commands() > refused_before
        fault.accept()
    run.report()
    assert run.problems() == [], run.diagnose([worker.output()])
    assert [run.runs(call) for call in calls] == [1] * len(calls)
    for call in calls:
        letter = run.letter(call)
        if not call.is_write:
            assert run.state(call) == "SUCCESS" and letter is None
            continue
        assert letter is not None, call
        assert (letter.reason, letter.failure_class, letter.exception_type) == (
            "not_retryable", "unknown", "AuditPersistenceFailed")
        assert letter.body_completed is True
        assert run.state(call) == "FAILURE"
        # The intent is the last thing the store took; the journal still says
        # running and keeps the write from ever being run again.
        phases = [event["phase"] for event in run.events(call)]
        assert phases[:1] == ["intent"] and "outcome" not in phases, phases
        assert run.journal(call)["state"] == "running"


@pytest.mark.parametrize("mode", MODES)
def test_refused_after_the_outcome_a_duplicate_changes_nothing(
    mode: str, make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    second_redis: RedisServer, main_redis: redis.Redis, prefix: str,
) -> None:
    with refusal(mode, second_redis) as fault:
        run = fault_run(make_app, main_redis, prefix, second_redis,
                        f"store refuses writes ({mode}) after the outcome")
        worker = spawn_worker(concurrency=9, store_url=fault.worker_url, TE_MAX_RETRIES="60")
        calls = run.submit_mix()
        wait_for(lambda: all(run.state(call) == "SUCCESS" for call in calls), timeout=30,
                 what="every call to succeed")
        refused_before = fault.refused_commands()
        fault.refuse()
        run.faults += 1
        for call in calls:
            run.deliver_again(call)
        reads = [call for call in calls if not call.is_write]
        wait_for(lambda: all(run.runs(call) == 2 for call in reads), timeout=30,
                 what="the reads to run again")
        wait_for(lambda: broker_holds(main_redis, prefix) == 0, timeout=30,
                 what="every duplicate to leave the broker")
        assert fault.refused_commands() > refused_before
        fault.accept()
        run.settle()
    run.report()
    assert run.problems() == [], run.diagnose([worker.output()])
    for call in calls:
        assert run.runs(call) == (1 if call.is_write else 2), call
        assert run.state(call) == "SUCCESS", call
        assert run.letter(call) is None, call
