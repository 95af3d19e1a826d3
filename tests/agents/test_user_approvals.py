"""The agent's user approves a call, and the worker enforces it (issue 42,
item 1), with a real ``celery worker`` of ``tests.apps.agent_tools_app``:
``shop.wire`` is approved by the agent's user (shown the account masked),
``shop.payout`` by the user then an operator, ``shop.refund`` by an operator
alone. What each SDK adds on top (its own pause and resume) is in
``test_adapter_approvals.py``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from celery_tooleffect import Approvals, ApprovalState, AuditLog
from celery_tooleffect.agents import ToolCaller
from celery_tooleffect.agents.approvals import UserApprovals
from celery_tooleffect.identity import call_task_id
from celery_tooleffect.states import CallStatus
from tests.agents.conftest import Agents
from tests.apps.agent_tools_app import build
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(180)

WIRE = {"account": "DE89370400440532013000", "cents": 500}


@dataclass
class World:
    """One test's app (a worker of it running), its caller and the user's
    side of approvals, and a key and run of its own."""

    app: Any
    caller: ToolCaller
    users: UserApprovals
    key: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    run: str = field(default_factory=lambda: f"run-{uuid.uuid4().hex[:6]}")


@pytest.fixture
def world(agents: Agents) -> World:
    agents.worker()
    app = build(agents.prefix)
    caller = ToolCaller.for_app(app)
    return World(app, caller, UserApprovals(caller))


def call(caller: ToolCaller, tool: str, arguments: dict[str, Any], call_id: str,
         run_id: str) -> Any:
    return anyio.run(lambda: caller.call(tool, arguments, call_id=call_id, run_id=run_id))


def events_of(app: Any, run: str, task_id: str) -> list[dict[str, Any]]:
    return [event for event in AuditLog(app).events(run) if event["task_id"] == task_id]


def decisions(app: Any, run: str, task_id: str) -> list[tuple[str, str]]:
    return [(event["status"], event.get("actor", "")) for event in events_of(app, run, task_id)
            if event["phase"] == "approval"]


def test_a_call_its_user_approved_before_it_was_published_runs_once(
    agents: Agents, world: World,
) -> None:
    app, caller, users, key, run = world.app, world.caller, world.users, world.key, world.run
    arguments = {"key": key, **WIRE}
    ask = users.ask("shop.wire", arguments, call_id="call_1", run_id=run)
    assert ask is not None and ask.approver == "user"
    # The person sees what the tool's approval_view shows, never the account.
    assert ask.shown == {"view": {"account": "****3000", "amount": "5.00"}}
    assert ask.task_id == call_task_id("call_1", run)

    decided = users.decide("shop.wire", arguments, call_id="call_1", run_id=run, approve=True,
                           seen=ask.digest, by="ana@example.com", via="test")
    assert decided and decided.state is ApprovalState.APPROVED, decided.message
    assert users.ask("shop.wire", arguments, call_id="call_1", run_id=run) is None
    again = users.decide("shop.wire", arguments, call_id="call_1", run_id=run, approve=False,
                         seen=ask.digest, by="mallory")
    assert not again and "decided already" in again.message  # once

    report = call(caller, "shop.wire", arguments, "call_1", run)
    assert report.status is CallStatus.SUCCEEDED, report
    assert report.result == "wired 500 to ****3000 (1)"
    # A resumed run that asks again for the call that ran gets its result.
    assert call(caller, "shop.wire", arguments, "call_1", run).result == report.result
    assert agents.runs(key) == 1
    events = events_of(app, run, ask.task_id)
    [approved] = [e for e in events if e["phase"] == "approval"]
    assert (approved["status"], approved["actor"], approved["via"], approved["shown_digest"]) \
        == ("approved", "ana@example.com", "test", ask.digest)
    assert [e["phase"] for e in events if e["phase"] in ("intent", "outcome")] == [
        "intent", "outcome"]


def test_a_client_that_skips_the_pause_gets_the_call_parked_not_run(
    agents: Agents, world: World,
) -> None:
    app, caller, users, key, run = world.app, world.caller, world.users, world.key, world.run
    arguments = {"key": key, **WIRE}
    waiting = call(caller, "shop.wire", arguments, "call_1", run)
    assert waiting.status is CallStatus.AWAITING_APPROVAL, waiting
    parked = Approvals(app).get(waiting.task_id)
    assert parked is not None and parked.state is ApprovalState.PENDING
    assert parked.approver == "user" and agents.runs(key) == 0

    ask = users.ask("shop.wire", arguments, call_id="call_1", run_id=run)
    assert ask is not None and ask.task_id == waiting.task_id
    decided = users.decide("shop.wire", arguments, call_id="call_1", run_id=run, approve=True,
                           seen=ask.digest, by="ana")
    assert decided, decided.message
    report = call(caller, "shop.wire", arguments, "call_1", run)
    assert report.status is CallStatus.SUCCEEDED, report
    assert agents.runs(key) == 1
    assert decisions(app, run, waiting.task_id) == [("requested", ""), ("approved", "ana")]


def test_arguments_other_than_those_shown_are_refused(agents: Agents, world: World) -> None:
    app, users, key, run = world.app, world.users, world.key, world.run
    shown = users.ask("shop.wire", {"key": key, **WIRE}, call_id="call_1", run_id=run)
    assert shown is not None
    larger = {"key": key, **WIRE, "cents": 5_000_000}
    refused = users.decide("shop.wire", larger, call_id="call_1", run_id=run, approve=True,
                           seen=shown.digest, by="ana")
    assert not refused and "not those shown" in refused.message
    assert users.state(shown.task_id, run) is ApprovalState.ABSENT  # nothing recorded

    # Approved for 5.00; a message of the same call id asking for 50,000.00,
    # published by a producer that bypasses the caller: the worker refuses it.
    assert users.decide("shop.wire", {"key": key, **WIRE}, call_id="call_1", run_id=run,
                        approve=True, seen=shown.digest, by="ana")
    forged = app.tasks["shop.wire"].apply_async(kwargs=larger, task_id=shown.task_id,
                                                 run_id=run)
    with pytest.raises(Exception, match="other arguments than this message carries"):
        forged.get(timeout=60)
    assert agents.runs(key) == 0


def test_an_operators_approval_is_never_given_from_the_agent_side(
    agents: Agents, world: World,
) -> None:
    app, caller, users, key, run = world.app, world.caller, world.users, world.key, world.run
    arguments = {"key": key, "cents": 700}
    assert users.ask("shop.refund", arguments, call_id="call_1", run_id=run) is None
    waiting = call(caller, "shop.refund", arguments, "call_1", run)
    assert waiting.status is CallStatus.AWAITING_APPROVAL
    digest = Approvals(app).arguments(Approvals(app).get(waiting.task_id)).digest  # type: ignore[arg-type]
    refused = users.decide("shop.refund", arguments, call_id="call_1", run_id=run,
                           approve=True, seen=digest, by="the model")
    assert not refused and "only an operator approves" in refused.message
    assert Approvals(app).get(waiting.task_id).state is ApprovalState.PENDING  # type: ignore[union-attr]
    assert agents.runs(key) == 0 and decisions(app, run, waiting.task_id) == [("requested", "")]


def test_a_call_approved_by_both_waits_for_its_user_then_an_operator(
    agents: Agents, world: World,
) -> None:
    app, caller, users, key, run = world.app, world.caller, world.users, world.key, world.run
    arguments = {"key": key, "cents": 9_000}
    ask = users.ask("shop.payout", arguments, call_id="call_1", run_id=run)
    assert ask is not None and ask.approver == "both"
    assert ask.shown == {"args": [], "kwargs": arguments, "problem": None}
    decided = users.decide("shop.payout", arguments, call_id="call_1", run_id=run,
                           approve=True, seen=ask.digest, by="ana")
    assert decided.state is ApprovalState.USER_APPROVED, decided.message

    # Published after its user approved it: the worker keeps the message and
    # the call waits for an operator.
    waiting = call(caller, "shop.payout", arguments, "call_1", run)
    assert waiting.status is CallStatus.AWAITING_APPROVAL, waiting
    record = wait_for(lambda: (lambda a: a if a and a.message else None)(
        Approvals(app).get(ask.task_id)), timeout=30, what="the message to be kept")
    assert record.state is ApprovalState.USER_APPROVED and record.user_decided_by == "ana"
    assert [a.task_id for a in Approvals(app).list()] == [ask.task_id]
    assert agents.runs(key) == 0

    approved = Approvals(app).approve(ask.task_id, by="olga")
    assert approved.ok, approved.message
    report = call(caller, "shop.payout", arguments, "call_1", run)
    assert report.status is CallStatus.SUCCEEDED, report
    assert agents.runs(key) == 1
    assert decisions(app, run, ask.task_id) == [("user_approved", "ana"), ("requested", ""),
                                           ("approved", "olga")]


def test_an_operator_cannot_approve_before_the_user_of_a_call_approved_by_both(
    agents: Agents, world: World,
) -> None:
    app, caller, users, key, run = world.app, world.caller, world.users, world.key, world.run
    arguments = {"key": key, "cents": 9_000}
    waiting = call(caller, "shop.payout", arguments, "call_1", run)
    assert waiting.status is CallStatus.AWAITING_APPROVAL
    early = Approvals(app).approve(waiting.task_id, by="olga")
    assert not early.ok and "waits for its user's approval first" in early.message
    ask = users.ask("shop.payout", arguments, call_id="call_1", run_id=run)
    assert ask is not None
    assert users.decide("shop.payout", arguments, call_id="call_1", run_id=run, approve=True,
                        seen=ask.digest, by="ana").state is ApprovalState.USER_APPROVED
    assert agents.runs(key) == 0
    assert Approvals(app).approve(waiting.task_id, by="olga").ok
    assert call(caller, "shop.payout", arguments, "call_1", run).status is CallStatus.SUCCEEDED
    assert agents.runs(key) == 1


def test_a_call_its_user_rejected_never_runs(agents: Agents, world: World) -> None:
    caller, users, key, run = world.caller, world.users, world.key, world.run
    arguments = {"key": key, **WIRE}
    ask = users.ask("shop.wire", arguments, call_id="call_1", run_id=run)
    assert ask is not None
    rejected = users.decide("shop.wire", arguments, call_id="call_1", run_id=run,
                            approve=False, seen=ask.digest, by="ana", reason="wrong account")
    assert rejected.state is ApprovalState.REJECTED
    # Published all the same: the worker ends it FAILURE, nothing runs.
    report = call(caller, "shop.wire", arguments, "call_1", run)
    assert report.status is CallStatus.REJECTED, report
    assert "rejected by ana: wrong account" in report.error
    assert agents.runs(key) == 0
