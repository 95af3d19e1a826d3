"""Deciding a call that needs approval, once: the decision an operator takes
(``admin/approvals.py``: the CLI, Flower), the decision the agent's user takes
(:func:`decide_as_user`: the agent adapters and the MCP server) and the expiry
the worker's sweep takes (``worker/approval_gate.py``) on calls nobody decided
within ``tooleffect_approval_timeout``.

A decision (:func:`decide_approval`) moves a ``pending`` record once, with
its audit event, then publishes the kept message again (the same bytes,
headers and properties), and takes the call off the pending index. A
decision whose message could not be published stays listed and is published
by the next sweep or decision attempt; a message published twice is harmless
(the journal runs a task id once, and a refused call ends once).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..effect import ToolEffect
from ..events import AuditEvent
from ..states import ApprovalState, Approver
from ..store import states
from ..store.approvals import Approval, ApprovalMove, overdue_before
from ..store.audit import FULL_VALUE_LIMIT, StepContext, describe_payload, worker_identity
from ..store.runtime import ToolRuntime, runtime_for
from .republish import republish
from .showing import Shown, canonical, show_call


def decision_event(approval: Approval, state: ApprovalState, *, by: str,
                   reason: str, via: str, shown: Mapping[str, str] | None = None
                   ) -> AuditEvent:
    """The audit event of a decision on ``approval``; ``shown``: what the
    person deciding was shown of the call (``shown_digest``, and at privacy
    ``full`` the ``shown`` values)."""
    context = StepContext(
        run_id=approval.run_id, task_id=approval.task_id, tool=approval.name,
        effect=ToolEffect.coerce(approval.effect), queue=approval.queue, redelivered=False,
        worker=worker_identity(),
    )
    details: dict[str, Any] = {"actor": by, "reason": reason, "via": via, **(shown or {})}
    return context.event("approval", state.value, **details)


def shown_details(shown: Shown, privacy: str) -> dict[str, str]:
    """What a decision's audit event records of what was shown: the digest
    (and the values themselves at privacy ``full``)."""
    details = {"shown_digest": shown.digest}
    if shown.problem:
        details["shown_problem"] = shown.problem[:500]
    if privacy == "full":
        details["shown"] = canonical(shown.values())[:FULL_VALUE_LIMIT]
    return details


def decide_approval(app: Any, approval: Approval, state: ApprovalState, *, by: str,
                    reason: str, via: str, shown: Mapping[str, str] | None = None
                    ) -> ApprovalMove:
    """Take an operator's decision ``state`` (approved, rejected, expired) on a
    call waiting for one, once, then publish its message again and take it off
    the pending index. An operator approves a call of a tool approved by
    ``both`` only once its user approved it (``user_approved``).

    The answer is false when the call was not waiting so (then nothing
    changed); a call decided before whose message was not published yet is
    published now. Raises :class:`StoreUnavailable`, or what publishing raises
    (the decision then stays recorded and listed, and is published later).
    """
    runtime = runtime_for(app)
    allowed = (states.operator_approves_from(Approver.coerce(approval.approver))
               if state is ApprovalState.APPROVED else states.DECIDE_FROM)
    move = runtime.approvals.transition(
        approval, new_state=state, allowed=allowed,
        event=decision_event(approval, state, by=by, reason=reason, via=via, shown=shown),
        fields={"decided_by": by, "decided_at": f"{time.time():.6f}", "reason": reason},
    )
    if move or _listed_but_decided(runtime, approval):
        publish_decided(app, approval)
        runtime.approvals.unlist(approval.task_id)
    return move


def _listed_but_decided(runtime: ToolRuntime, approval: Approval) -> bool:
    current = runtime.approvals.get(approval.task_id)
    return (current is not None and current.decided
            and runtime.approvals.is_listed(approval.task_id))


def publish_decided(app: Any, approval: Approval) -> None:
    """Publish the call's kept message again, exactly as it was delivered."""
    if approval.message is None:
        raise ValueError(f"{approval.name}[{approval.task_id}]: no message kept")
    republish(app, approval.message, approval.queue)


def expire_overdue_approvals(app: Any, now: float | None = None) -> list[Approval]:
    """Reject as expired every call parked longer than ``tooleffect_approval_timeout``
    (and publish decisions left unpublished); the calls expired now."""
    runtime = runtime_for(app)
    expired = []
    for approval in runtime.approvals.listed(older_than=overdue_before(runtime.settings, now)):
        if approval.decided:
            publish_decided(app, approval)
            runtime.approvals.unlist(approval.task_id)
            continue
        move = decide_approval(app, approval, ApprovalState.EXPIRED, by="tooleffect",
                               via="sweep",
                               reason="no decision within tooleffect_approval_timeout "
                                      f"({runtime.settings.approval_timeout:g} s)")
        if move:
            expired.append(approval)
    return expired


# -- the agent's user ----------------------------------------------------------------


@dataclass(frozen=True)
class UserDecision:
    """The answer of :func:`decide_as_user`."""

    #: True when the decision was recorded now.
    decided: bool
    #: Where the call's approval stands afterwards.
    state: ApprovalState
    #: What happened, for the person and the model (a refusal says why).
    message: str

    def __bool__(self) -> bool:
        return self.decided


def decide_as_user(app: Any, task: Any, *, task_id: str, run_id: str, args: Any, kwargs: Any,
                   approve: bool, seen: str, by: str, reason: str = "", via: str = "agent",
                   ) -> UserDecision:
    """Record the agent's user's decision on the call ``task_id`` of ``task``
    with ``args`` and ``kwargs``, once, with its audit event; ``seen`` is the
    digest of what the person was shown (:func:`show_call`).

    Refused (nothing recorded): a call whose tool an operator alone approves
    (an operator's approval is never given from the agent's side), ``seen``
    another digest than these arguments show, a call decided already. A call
    not published yet gets its record now (the worker runs it, once, only
    with arguments that show the same digest); a call the worker parked is
    published again once finally decided. For a tool approved by ``both``, an
    approval leaves the call waiting for an operator.

    Raises :class:`StoreUnavailable`, or what publishing raises (then the
    decision stands and the next sweep publishes it).
    """
    name = str(task.name)
    label = f"{name}[{task_id}]"
    approver = task.approver_for(tuple(args or ()), dict(kwargs or {}))
    if approver is None:
        return UserDecision(False, ApprovalState.ABSENT, f"{label} needs no approval")
    if not approver.asks_user:
        return UserDecision(False, ApprovalState.ABSENT,
                            f"{label}: only an operator approves this call (CLI or Flower); "
                            "nothing was decided from the agent's side")
    shown = show_call(task, args, kwargs)
    if seen != shown.digest:
        return UserDecision(False, ApprovalState.ABSENT,
                            f"{label}: these arguments are not those shown to the person "
                            "deciding (another digest); nothing was decided")
    state = (ApprovalState.REJECTED if not approve else
             ApprovalState.APPROVED if approver is Approver.USER else
             ApprovalState.USER_APPROVED)
    runtime = runtime_for(app)
    now = time.time()
    final = state is not ApprovalState.USER_APPROVED
    fields = {"user_decided_by": by, "shown_digest": shown.digest}
    if final:
        fields.update(decided_by=by, decided_at=f"{now:.6f}", reason=reason)
    details = shown_details(shown, runtime.settings.privacy)
    record = Approval(
        task_id=task_id, run_id=run_id, name=name,
        queue=str(getattr(task, "queue", None) or app.conf.task_default_queue),
        effect=task.tool_effect.value,
        state=state, requested_at=now, approver=approver.value,
        arguments=describe_payload(runtime.settings.privacy, args=list(args or ()),
                                   kwargs=dict(kwargs or {})),
        shown_digest=shown.digest, user_decided_by=by,
        decided_by=by if final else "", decided_at=now if final else None,
        reason=reason if final else "",
    )
    event = decision_event(record, state, by=by, reason=reason, via=via, shown=details)
    existing = runtime.approvals.record_decision(record, event)
    if existing is None:
        return UserDecision(True, state, f"{label} {state.value} by {by} before it was "
                                         "published")
    current = runtime.approvals.get(task_id)
    if current is None or existing not in states.USER_DECIDE_FROM:
        return UserDecision(False, existing, f"{label} was decided already: {existing.value}")
    move = runtime.approvals.transition(current, new_state=state,
                                        allowed=states.USER_DECIDE_FROM, event=event,
                                        fields=fields)
    if not move:
        return UserDecision(False, move.previous,
                            f"{label} was decided meanwhile: {move.previous.value}")
    if final:
        publish_decided(app, current)
        runtime.approvals.unlist(task_id)
    return UserDecision(True, state, f"{label} {state.value} by {by}")
