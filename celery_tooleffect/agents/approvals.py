"""The agent's user approves a call, in the agent's own loop.

A tool whose ``requires_approval`` names the user (``Approver.USER``, or
``Approver.BOTH``: the user, then an operator) pauses the agent's run the
SDK's way before the call is published; each adapter asks
:meth:`UserApprovals.ask` whether this call waits for its user, shows the
person the :class:`ApprovalAsk` (its tool, its task id, what the package
shows of its arguments and their digest: the tool's ``approval_view``), and
records the person's answer with :meth:`UserApprovals.decide` when the run
resumes, in this process or another one.

The worker, not the adapter, enforces the decision: a call of such a tool
runs only once a decision for exactly the arguments shown (their digest) is
recorded, used once (its task id runs once); a client that skips the pause
and publishes the call gets it parked, not run; a tool an operator alone
approves cannot be approved from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..actions.approving import UserDecision, decide_as_user
from ..actions.showing import show_call
from ..identity import call_task_id, checked_id
from ..states import ApprovalState, approver_of
from ..store.runtime import runtime_for
from .calls import ToolCaller

__all__ = ["ApprovalAsk", "UserApprovals", "UserDecision", "may_ask_user"]

#: Where a call still waits for its user's decision: not published yet, or parked.
_UNDECIDED = frozenset({ApprovalState.ABSENT, ApprovalState.PENDING})


@dataclass(frozen=True)
class ApprovalAsk:
    """What the person approving a call is asked: which call, and what it does."""

    tool: str
    task_id: str
    run_id: str
    call_id: str
    #: Who approves the call (an Approver value: user, or both).
    approver: str
    #: What is shown of its arguments: ``{"view": ...}`` (the tool's
    #: ``approval_view``) or ``{"args", "kwargs", "problem"}``.
    shown: dict[str, Any]
    #: The digest of :attr:`shown`: the decision is bound to it.
    digest: str
    #: The arguments as the agent gave them (validated), for the resume.
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: what an interrupt or a pending request carries."""
        return {"tool": self.tool, "task_id": self.task_id, "run_id": self.run_id,
                "call_id": self.call_id, "approver": self.approver, "shown": self.shown,
                "digest": self.digest}

    def question(self) -> str:
        """One line for the person: what they approve."""
        then = " (then an operator approves it too)" if self.approver == "both" else ""
        shown = json.dumps(self.shown.get("view", self.shown), ensure_ascii=False,
                           sort_keys=True)
        return f"Approve {self.tool} with {shown}{then}?"


def may_ask_user(task: Any) -> bool:
    """Whether a call of ``task`` may wait for its user's decision: its
    ``requires_approval`` names the user (or both), or is a policy that may."""
    policy = type(task).requires_approval
    if callable(policy):
        return True
    try:
        approver = approver_of(policy)
    except ValueError:
        return False
    return approver is not None and approver.asks_user


class UserApprovals:
    """The user's side of approvals for an agent's calls of ``caller``'s app."""

    def __init__(self, caller: ToolCaller) -> None:
        self.caller = caller
        self.app = caller.app

    def ask(self, tool: str, arguments: Any, *, call_id: str, run_id: str) -> ApprovalAsk | None:
        """What to ask the agent's user before this call is published; None
        when the call waits for no decision of its user (it needs no
        approval, an operator alone approves it, or its user decided it:
        then the worker holds it to that decision). Invalid arguments raise
        ``InvalidToolArguments``, as the call itself would."""
        ask = self.view(tool, arguments, call_id=call_id, run_id=run_id)
        if ask is None or self.state(ask.task_id, run_id) not in _UNDECIDED:
            return None
        return ask

    def view(self, tool: str, arguments: Any, *, call_id: str,
             run_id: str) -> ApprovalAsk | None:
        """What its user is (or was) asked about this call, decided or not;
        None when its user decides nothing on it (it needs no approval, or
        an operator alone approves it). Invalid arguments raise
        ``InvalidToolArguments``."""
        spec = self.caller.spec(tool)
        kwargs = spec.validate(arguments)
        task = self.app.tasks[spec.name]
        approver = task.approver_for((), kwargs)
        if approver is None or not approver.asks_user:
            return None
        task_id = call_task_id(checked_id(call_id, "call_id"), run_id)
        shown = show_call(task, (), kwargs)
        return ApprovalAsk(tool=spec.name, task_id=task_id, run_id=run_id, call_id=call_id,
                           approver=approver.value, shown=shown.values(), digest=shown.digest,
                           arguments=kwargs)

    def decide(self, tool: str, arguments: Any, *, call_id: str, run_id: str, approve: bool,
               seen: str, by: str, reason: str = "", via: str = "agent") -> UserDecision:
        """Record the person's decision on this call (``seen``: the digest
        they were shown, :attr:`ApprovalAsk.digest`), once, with its audit
        event; refused (nothing recorded) for arguments that show another
        digest, a tool an operator alone approves, or a call decided already.
        ``via`` names the SDK or client that asked."""
        spec = self.caller.spec(tool)
        kwargs = spec.validate(arguments)
        return decide_as_user(
            self.app, self.app.tasks[spec.name],
            task_id=call_task_id(checked_id(call_id, "call_id"), run_id), run_id=run_id,
            args=(), kwargs=kwargs, approve=approve, seen=seen, by=by, reason=reason, via=via)

    def state(self, task_id: str, run_id: str) -> ApprovalState:
        """Where the call's approval stands (``absent``: nothing recorded)."""
        return runtime_for(self.app).approvals.decision(run_id, task_id)[0]

    def rejection(self, ask: ApprovalAsk) -> str:
        """What the model is told of a call its user (or an operator, or the
        sweep) rejected: by whom, why, and that nothing ran."""
        record = runtime_for(self.app).approvals.get(ask.task_id)
        state = record.state.value if record is not None else "rejected"
        who = (record.decided_by if record is not None else "") or "its user"
        why = (record.reason if record is not None else "") or ""
        return (f"{ask.tool} was {state} by {who}{': ' + why if why else ''}; it did not run "
                f"(task_id {ask.task_id}). Do not call it again unless the user asks for it.")
