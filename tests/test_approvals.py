"""Approval before a write, with real workers: a call that needs a person's
approval is parked (nothing of it runs) until an operator decides.

``tools.approved_write`` (tests/apps/tool_app.py) needs approval for every
call, ``tools.refund`` for refunds above 100 only; the app's
``approval_requested`` receiver lists each parked call.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import (
    ApprovalRejected,
    ApprovalRequired,
    Approvals,
    ApprovalState,
    AuditLog,
    DeadLetters,
    EffectRelabelRefused,
    ToolDeclarationError,
    ToolEffect,
    ToolTask,
)
from celery_tooleffect.store.approvals import Approval
from celery_tooleffect.store.audit import StepContext
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import RedisServer, redis_server
from tests.conftest import REDIS_URL, Counter, WorkerProcess, on_broker, wait_for

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def app(make_app: Callable[..., Celery], prefix: str, broker_url: str) -> Celery:
    return make_app(**on_broker(prefix, broker_url))


def parked(client: redis.Redis, prefix: str) -> list[str]:
    return [item.decode() for item in client.lrange(f"{prefix}parked", 0, -1)]


def errbacks(client: redis.Redis, prefix: str) -> list[str]:
    return [item.decode() for item in client.lrange(f"{prefix}errbacks", 0, -1)]


def approval_events(app: Celery, run_id: str) -> list[tuple[str, str]]:
    return [(e["phase"], e["status"]) for e in AuditLog(app).events(run_id)
            if e["phase"] in ("approval", "outcome", "intent")]


def wait_parked(app: Celery, task_id: str) -> Any:
    return wait_for(lambda: Approvals(app).get(task_id), timeout=60,
                    what=f"{task_id} to be parked")


def test_a_parked_call_runs_once_when_approved(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result: Any = app.send_task("tools.approved_write", args=[key], queue="tools")
    approval = wait_parked(app, result.id)

    assert approval.state is ApprovalState.PENDING
    assert approval.name == "tools.approved_write" and approval.queue == "tools"
    assert approval.arguments == {"args_size": str(len(json.dumps([key]))), "kwargs_size": "2"}
    # The signal fires once the record is stored, before the acknowledgement.
    assert wait_for(lambda: parked(main_redis, prefix), timeout=30) == [result.id]
    assert counter.value(key) == 0 and result.state == "PENDING"
    assert [a.task_id for a in Approvals(app).list()] == [result.id]

    decided = Approvals(app).approve(result.id, by="alice", reason="looks right")
    assert decided.ok, decided.message
    assert result.get(timeout=60) == key
    assert counter.value(key) == 1
    assert Approvals(app).get(result.id).state is ApprovalState.APPROVED
    assert Approvals(app).list() == []
    assert approval_events(app, result.id) == [
        ("approval", "requested"), ("approval", "approved"),
        ("intent", "started"), ("outcome", "succeeded"),
    ]
    [decision] = [e for e in AuditLog(app).events(result.id) if e["status"] == "approved"]
    assert (decision["actor"], decision["reason"], decision["via"]) == (
        "alice", "looks right", "python")


def test_a_rejected_call_fails_runs_its_errback_and_stops_its_chain(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key, after = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    first = app.signature("tools.approved_write", args=[key], queue="tools")
    first.link_error(app.signature("tools.errback", queue="tools"))
    workflow = first | app.signature("tools.read", args=[after], immutable=True, queue="tools")
    result = workflow.apply_async()
    gated = result.parent
    wait_parked(app, gated.id)

    decided = Approvals(app).reject(gated.id, by="bob", reason="amount too high")
    assert decided.ok, decided.message
    with pytest.raises(ApprovalRejected, match="rejected by bob: amount too high"):
        gated.get(timeout=60)
    assert wait_for(lambda: errbacks(main_redis, prefix), timeout=30) == [
        f"{gated.id} ApprovalRejected"]
    assert counter.value(key) == 0 and counter.value(after) == 0  # nothing ran
    # The chain stopped: Celery's mark_as_failure marks its later tasks failed too.
    assert result.state == "FAILURE" and isinstance(result.result, ApprovalRejected)
    # The worker stores the result (what get() waits for), then ends the record.
    wait_for(lambda: Approvals(app).get(gated.id).state is ApprovalState.ENDED,  # type: ignore[union-attr]
             timeout=30, what="the approval record to end")
    assert approval_events(app, gated.id) == [
        ("approval", "requested"), ("approval", "rejected"), ("outcome", "rejected")]
    # Audited once, with the record's move: the task_failure handler knows it.
    assert "failure_reported" not in {e["phase"] for e in AuditLog(app).events(gated.id)}
    assert DeadLetters(app).get(gated.id) is None  # a decision, not a failure to keep


def test_a_call_nobody_decides_expires(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, prefix: str,
) -> None:
    app = make_app(tooleffect_approval_timeout=1.0)
    spawn_worker(concurrency=1, TE_APPROVAL_TIMEOUT="1")
    key = uuid.uuid4().hex[:8]
    result: Any = app.send_task("tools.approved_write", args=[key], queue="tools")
    wait_parked(app, result.id)

    # The worker's sweep (every timeout/4 here, 1 s at least) rejects it as expired.
    with pytest.raises(ApprovalRejected, match="expired awaiting approval"):
        result.get(timeout=60)
    # The worker stores the result (what get() waits for), then ends the record.
    approval = wait_for(lambda: (found := Approvals(app).get(result.id)) is not None
                        and found.state is ApprovalState.ENDED and found,
                        timeout=30, what="the approval record to end")
    assert approval.state is ApprovalState.ENDED
    assert approval.decided_by == "tooleffect" and "approval_timeout" in approval.reason
    assert counter.value(key) == 0
    assert approval_events(app, result.id)[-2:] == [("approval", "expired"),
                                                    ("outcome", "expired")]


def test_the_policy_parks_only_the_calls_it_names(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    small, large = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    ran: Any = app.send_task("tools.refund", args=[small, 50], queue="tools")
    waits: Any = app.send_task("tools.refund", args=[large, 500], queue="tools")
    assert ran.get(timeout=60) == 50 and counter.value(small) == 1
    wait_parked(app, waits.id)
    assert Approvals(app).get(ran.id) is None
    assert counter.value(large) == 0
    assert Approvals(app).approve(waits.id, reason="checked").ok
    assert waits.get(timeout=60) == 500 and counter.value(large) == 1


def test_a_second_decision_is_refused(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result: Any = app.send_task("tools.approved_write", args=[key], queue="tools")
    wait_parked(app, result.id)
    assert Approvals(app).approve(result.id, by="alice").ok
    again = Approvals(app).approve(result.id, by="carol")
    rejected_late = Approvals(app).reject(result.id, by="carol", reason="too late")
    assert result.get(timeout=60) == key
    assert (again.outcome.value, rejected_late.outcome.value) == ("refused", "refused")
    assert "decided already: approved by alice" in again.message
    assert counter.value(key) == 1
    decisions = [e["status"] for e in AuditLog(app).events(result.id) if e["phase"] == "approval"]
    assert decisions == ["requested", "approved"]


def test_a_forged_approval_header_is_refused(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    # A producer that is not a ToolTask (send_task checks nothing) sets the
    # worker's own field as a header: the worker refuses the message.
    result: Any = app.send_task("tools.approved_write", args=[key], queue="tools",
                                headers={"tooleffect_approved": "1"})
    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                      what="the refused message's dead letter")
    assert letter.reason == "malformed_message"
    assert "tooleffect_approved" in letter.error
    assert counter.value(key) == 0
    assert Approvals(app).get(result.id) is None


def test_a_worker_killed_between_parking_and_acknowledging_leaves_one_record(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, main_redis: redis.Redis, prefix: str,
) -> None:
    visibility_timeout = 3.0
    app = make_app(**on_broker(prefix, REDIS_URL, visibility_timeout=visibility_timeout))
    first = spawn_worker(concurrency=1, visibility_timeout=visibility_timeout,
                         TE_KILL_ON_PARK="1")
    key = uuid.uuid4().hex[:8]
    result: Any = app.send_task("tools.approved_write", args=[key], queue="tools")
    wait_for(lambda: first.process.poll() is not None, timeout=60,
             what="the worker to kill itself after parking")
    # The record is stored and the message was never acknowledged: a new
    # worker gets it again once the visibility timeout lapses.
    spawn_worker(concurrency=1, visibility_timeout=visibility_timeout)
    wait_for(lambda: main_redis.hlen(f"{prefix}unacked") == 0
             and main_redis.llen(f"{prefix}tools") == 0, timeout=60,
             what="the redelivered message to be acknowledged")
    assert [a.task_id for a in Approvals(app).list()] == [result.id]
    requested = [e for e in AuditLog(app).events(result.id) if e["phase"] == "approval"]
    assert [e["status"] for e in requested] == ["requested"]
    assert parked(main_redis, prefix) == [result.id]  # the signal fired once
    assert Approvals(app).approve(result.id).ok
    assert result.get(timeout=60) == key
    assert counter.value(key) == 1


def test_with_the_store_down_the_call_stays_on_the_broker(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, main_redis: redis.Redis, prefix: str, second_redis: RedisServer,
) -> None:
    app = make_app(tooleffect_redis_url=second_redis.url)
    worker = spawn_worker(concurrency=1, store_url=second_redis.url)
    second_redis.kill()
    key = uuid.uuid4().hex[:8]
    result: Any = app.send_task("tools.approved_write", args=[key], queue="tools")
    wait_for(lambda: "the store did not answer; requeueing" in worker.output(), timeout=60,
             what="the worker to requeue the call")
    # Not acknowledged: the message goes round (queued, held unacknowledged, or
    # between the two inside the worker), and is parked once the store is back.
    wait_for(lambda: main_redis.llen(f"{prefix}tools") + main_redis.hlen(f"{prefix}unacked"),
             timeout=30, what="the message on the broker")
    second_redis.restart()
    wait_parked(app, result.id)
    assert [a.task_id for a in Approvals(app).list()] == [result.id]
    assert counter.value(key) == 0


def test_an_interactive_call_is_refused_without_approval(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()

    @app.task(base=ToolTask, name="local.approved", effect=ToolEffect.IDEMPOTENT_WRITE,
              requires_approval=True)
    def approved(x: int) -> int:
        return x

    with pytest.raises(ApprovalRequired, match="needs a person's approval"):
        approved(1)
    with pytest.raises(ApprovalRequired):
        approved.apply(args=[1]).get()


def test_approval_is_declared_in_code_only(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(base=ToolTask, name="local.read", shared=False, requires_approval=True)
    def read(x: int) -> int:
        return x

    with pytest.raises(ToolDeclarationError, match="nothing to approve"):
        app.tasks[read.name]

    annotated_app = make_app(task_annotations={"local.annotated": {"requires_approval": False}})

    @annotated_app.task(base=ToolTask, name="local.annotated", shared=False,
                        effect=ToolEffect.IDEMPOTENT_WRITE, requires_approval=True)
    def annotated(x: int) -> int:
        return x

    with pytest.raises(EffectRelabelRefused, match="requires_approval"):
        annotated_app.tasks[annotated.name]

    calling_app = make_app()

    @calling_app.task(base=ToolTask, name="local.call", shared=False,
                      effect=ToolEffect.IDEMPOTENT_WRITE, requires_approval=True)
    def call(x: int) -> int:
        return x

    with pytest.raises(EffectRelabelRefused, match="requires_approval"):
        call.apply_async(args=[1], requires_approval=False)


# -- decided calls stay listed (the store) ------------------------------------------------


def decide_in_store(app: Celery, task_id: str, *, tool: str, queue: str,
                    state: ApprovalState, decided_at: float) -> None:
    """Park a call and decide it ``state`` at ``decided_at``, as the worker and an
    operator do, through the store alone."""
    store = runtime_for(app).approvals
    approval = Approval(task_id=task_id, run_id=f"run-{task_id}", name=tool, queue=queue,
                        effect="non_idempotent_write", state=ApprovalState.PENDING,
                        requested_at=decided_at - 60)
    context = StepContext(run_id=approval.run_id, task_id=task_id, tool=tool,
                          effect=ToolEffect.NON_IDEMPOTENT_WRITE, queue=queue,
                          redelivered=False, worker="test:1")
    assert store.request(approval, context.event("approval", "requested")) is None
    moved = store.transition(
        approval, new_state=state, allowed=frozenset({ApprovalState.PENDING}),
        event=context.event("approval", state.value, actor="ops"),
        fields={"decided_by": "ops", "decided_at": f"{decided_at:.6f}", "reason": "r"})
    assert moved
    store.unlist(task_id)  # as once its message is published again


def test_decided_calls_are_paged_newest_decision_first_for_the_retention(
    make_app: Callable[..., Celery],
) -> None:
    day = 86400.0
    app = make_app(tooleffect_approval_retention=day)
    now = time.time()
    for number in range(5):
        decide_in_store(app, f"ok-{number}", tool="tools.approved_write", queue="tools",
                        state=ApprovalState.APPROVED, decided_at=now - 100 + number)
    decide_in_store(app, "refund-1", tool="tools.refund", queue="money",
                    state=ApprovalState.APPROVED, decided_at=now - 50)
    decide_in_store(app, "no-1", tool="tools.refund", queue="money",
                    state=ApprovalState.REJECTED, decided_at=now - 40)
    # Decided before the retention: not listed (trimmed when the next decision is written).
    decide_in_store(app, "old-1", tool="tools.approved_write", queue="tools",
                    state=ApprovalState.APPROVED, decided_at=now - day - 10)
    store = runtime_for(app).approvals

    def ids(state: ApprovalState = ApprovalState.APPROVED, **query: Any) -> tuple[list[str], int]:
        page = store.decided(state, **query)
        return [approval.task_id for approval in page.approvals], page.total

    assert ids(limit=3) == (["refund-1", "ok-4", "ok-3"], 6)
    assert ids(limit=3, offset=3) == (["ok-2", "ok-1", "ok-0"], 6)
    assert ids(limit=3, offset=6) == ([], 6)
    assert ids(tool="tools.refund") == (["refund-1"], 1)
    assert ids(queue="tools", limit=2) == (["ok-4", "ok-3"], 5)
    assert ids(queue="money", tool="tools.refund") == (["refund-1"], 1)
    assert ids(queue="money", tool="tools.approved_write") == ([], 0)
    assert ids(ApprovalState.REJECTED) == (["no-1"], 1)
    assert ids(ApprovalState.EXPIRED) == ([], 0)
    # A day on, every one of them is past the retention.
    assert ids(now=now + day) == ([], 0)
    assert Approvals(app).list() == []  # none waits: the waiting list is as before
    with pytest.raises(ValueError, match="not a decision"):
        store.decided(ApprovalState.PENDING)


def test_a_page_of_decided_calls_reads_only_what_it_shows(
    make_app: Callable[..., Celery],
) -> None:
    with redis_server() as server:
        app = make_app(broker_url="memory://", result_backend="cache+memory://",
                       tooleffect_redis_url=server.url)
        now = time.time()
        for number in range(40):
            decide_in_store(app, f"call-{number}", tool="tools.approved_write", queue="tools",
                            state=ApprovalState.APPROVED, decided_at=now - number)
        client = server.client()
        client.config_resetstat()
        page = runtime_for(app).approvals.decided(ApprovalState.APPROVED, limit=5, offset=10)
        stats = client.info("commandstats")
    assert [a.task_id for a in page.approvals] == [f"call-{n}" for n in range(10, 15)]
    assert page.total == 40
    calls = {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}
    assert calls["hgetall"] == 5 and calls["hmget"] == 1
    assert calls["zrevrangebyscore"] == 1 and calls["zcount"] == 1
    assert "zrange" not in calls and "scan" not in calls
