"""``Approvals(app)``: what operators do with calls that wait for a person.

The same operations back ``celery tooleffect approvals ...`` and the Flower
Approvals page. Each decision is taken once, atomically with its audit event
(who, when, why), then the call's kept message is published again: an
approved call runs under the normal rules, a rejected one ends FAILURE with
``ApprovalRejected`` on the worker that receives it (the worker's approval
gate; the decisions themselves are :mod:`celery_tooleffect.actions.approving`).
Reading a list or the counts also expires the calls nobody decided within
``tooleffect_approval_timeout``, as the workers' sweep does, so an operator
never sees an overdue call as pending.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..actions.approving import decide_approval, expire_overdue_approvals, shown_details
from ..actions.showing import Shown, show_call
from ..states import ApprovalState, Approver
from ..store.approvals import DECISIONS, Approval
from ..store.runtime import runtime_for
from .operations.results import ActionResult, Outcome, default_actor
from .operations.stores import STORE_ERRORS
from .visible import invisible

if TYPE_CHECKING:
    from celery import Celery

_VERBS = {ApprovalState.APPROVED: "approve", ApprovalState.REJECTED: "reject"}


@dataclass(frozen=True)
class ApprovalListing:
    """One page of listed calls, oldest first: what ``approvals list`` and the
    Approvals page show, and (:meth:`to_dict`) the one listing view, the JSON
    of ``approvals list --json`` and of ``GET /api/approvals``."""

    approvals: list[Approval]
    offset: int
    limit: int
    #: Every listed call the filters match, on any page.
    total: int

    @property
    def next_offset(self) -> int | None:
        """The ``offset`` of the next page; None on the last one."""
        end = self.offset + self.limit
        return end if end < self.total else None

    def to_dict(self, *, paging: bool = False) -> dict[str, Any]:
        """The JSON of ``approvals list --json``: ``{"approvals": [Approval.to_dict()...],
        "count": N}`` (``count``: on this page). With ``paging``, that of ``GET
        /api/approvals``, which adds ``next_offset`` (null on the last page) and
        ``total`` (every call the filters match)."""
        listed: dict[str, Any] = {
            "approvals": [approval.to_dict() for approval in self.approvals],
            "count": len(self.approvals),
        }
        if paging:
            listed.update(next_offset=self.next_offset, total=self.total)
        return listed


@dataclass(frozen=True)
class ShownArguments(Shown):
    """What the people who decide are shown of a call's arguments
    (:class:`~celery_tooleffect.actions.showing.Shown`): decoded from its kept
    message with the app's ``accept_content`` (as a dead letter's page does;
    nothing of it is run), and what the pages and the CLI add to it."""

    @property
    def invisible(self) -> list[str]:
        """The invisible or text-reordering characters in what is shown
        (``["U+202E RIGHT-TO-LEFT OVERRIDE"]``): the pages and the CLI show
        them escaped and warn of them (:mod:`..visible`)."""
        return invisible(self.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: ``approvals show --json``'s ``shown`` and the API's. The
        values are the call's own (the digest is over them); ``invisible``
        names the characters in them that a person would not see."""
        return {"args": self.args, "kwargs": self.kwargs, "view": self.view,
                "problem": self.problem or None, "digest": self.digest,
                "invisible": self.invisible}

    def audit_details(self, privacy: str) -> dict[str, str]:
        """What the decision's audit event records of it: the digest (and the
        values themselves at privacy ``full``)."""
        return shown_details(self, privacy)


class Approvals:
    """Calls parked for approval in ``app``'s store: list, show, approve, reject."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.runtime = runtime_for(app)
        self._imported = False

    # -- reading ---------------------------------------------------------------

    def list(self, *, queue: str | None = None, tool: str | None = None,
             state: ApprovalState | str | None = None, limit: int | None = None,
             offset: int = 0) -> builtins.list[Approval]:
        """Listed calls: pending, or decided and not yet published, oldest first;
        with ``state`` approved, rejected or expired, the calls decided so within
        ``tooleffect_approval_retention``, newest decision first. Filters by
        queue and tool; ``offset``/``limit`` page."""
        wanted = ApprovalState.coerce(state) if state is not None else None
        if wanted in DECISIONS:
            return self.listing(queue=queue, tool=tool, state=wanted,
                                limit=limit or 1_000_000, offset=offset).approvals
        self.expire_overdue()
        found = [
            approval for approval in self.runtime.approvals.listed()
            if (queue is None or approval.queue == queue)
            and (tool is None or approval.name == tool)
            and (wanted is None or approval.state is wanted)
        ]
        end = None if limit is None else offset + limit
        return found[offset:end]

    def listing(self, *, queue: str | None = None, tool: str | None = None,
                state: ApprovalState | str | None = None, limit: int = 50,
                offset: int = 0) -> ApprovalListing:
        """:meth:`list`'s calls from ``offset`` on, at most ``limit``, with how many
        match in all (decided calls: a page costs what it shows)."""
        wanted = ApprovalState.coerce(state) if state is not None else None
        if wanted in DECISIONS:
            self.expire_overdue()
            page = self.runtime.approvals.decided(wanted, queue=queue, tool=tool, limit=limit,
                                                  offset=offset)
            return ApprovalListing(page.approvals, offset, limit, page.total)
        found = self.list(queue=queue, tool=tool, state=wanted)
        return ApprovalListing(found[offset:offset + limit], offset, limit, len(found))

    def get(self, task_id: str) -> Approval | None:
        """The call's record, pending or decided; None when it never waited."""
        return self.runtime.approvals.get(task_id)

    def _tasks(self) -> Any:
        """The app's task registry, its modules imported once (``include``,
        autodiscovery): a tool's ``approval_view`` lives there."""
        if not self._imported:
            self.app.loader.import_default_modules()
            self._imported = True
        return self.app.tasks

    def arguments(self, approval: Approval) -> ShownArguments:
        """What a person deciding ``approval`` is shown of its arguments
        (:class:`ShownArguments`); never raises for what the message or the
        tool's ``approval_view`` does."""
        if approval.message is None:
            return ShownArguments(problem="no message kept")
        try:
            args, kwargs, _ = approval.message.task_payload(self.app.conf.accept_content)
        except Exception as exc:
            return ShownArguments(
                problem=f"the arguments cannot be decoded with this app's accept_content "
                        f"({type(exc).__name__}: {exc}); nothing of them is shown")
        task = self._tasks().get(approval.name)
        if task is None:
            return ShownArguments(
                problem=f"{approval.name} is no task of this app, so its approval_view (if "
                        "it has one) cannot be applied: the arguments are hidden")
        shown = show_call(task, args, kwargs)
        return ShownArguments(args=shown.args, kwargs=shown.kwargs, view=shown.view,
                              problem=shown.problem)

    def stats(self) -> dict[str, Any]:
        """Pending calls by queue and tool: ``{"pending": n, "by_queue": {...},
        "by_tool": {...}, "by_queue_and_tool": [{"queue", "tool", "pending"}]}``."""
        self.expire_overdue()
        counts = self.runtime.approvals.pending_counts()
        by_queue: dict[str, int] = {}
        by_tool: dict[str, int] = {}
        for (queue, tool), count in counts.items():
            by_queue[queue] = by_queue.get(queue, 0) + count
            by_tool[tool] = by_tool.get(tool, 0) + count
        return {
            "pending": sum(counts.values()),
            "by_queue": by_queue,
            "by_tool": by_tool,
            "by_queue_and_tool": [
                {"queue": queue, "tool": tool, "pending": count}
                for (queue, tool), count in sorted(counts.items())
            ],
        }

    # -- deciding --------------------------------------------------------------

    def approve(self, task_id: str, *, by: str | None = None, reason: str = "",
                via: str = "python", seen: str | None = None) -> ActionResult:
        """Approve a pending call: it is published again and runs once. ``by``
        (default ``$TOOLEFFECT_ACTOR`` or ``user@host``), ``reason``, ``via``
        (``cli``, ``flower``, ``python``) and the digest of what is shown of its
        arguments (:meth:`arguments`) are written in the audit event. ``seen``:
        the digest the person deciding was shown; another one refuses the
        decision (what is shown changed meanwhile)."""
        return self._decide(task_id, ApprovalState.APPROVED, by=by, reason=reason, via=via,
                            seen=seen)

    def reject(self, task_id: str, *, by: str | None = None, reason: str = "",
               via: str = "python", seen: str | None = None) -> ActionResult:
        """Reject a pending call: it ends FAILURE (``ApprovalRejected``), nothing runs."""
        return self._decide(task_id, ApprovalState.REJECTED, by=by, reason=reason, via=via,
                            seen=seen)

    def expire_overdue(self) -> builtins.list[Approval]:
        """Reject as expired the calls that waited past the timeout (see the module docs)."""
        return expire_overdue_approvals(self.app)

    def _decide(self, task_id: str, state: ApprovalState, *, by: str | None,
                reason: str, via: str, seen: str | None = None) -> ActionResult:
        verb = _VERBS[state]
        actor = by or default_actor()
        try:
            approval = self.runtime.approvals.get(task_id)
            if approval is None:
                return ActionResult(task_id, verb, Outcome.NOT_FOUND,
                                    f"{task_id}: no call waits for approval under this id")
            if (state is ApprovalState.APPROVED and approval.state is ApprovalState.PENDING
                    and approval.approver == Approver.BOTH):
                return ActionResult(
                    task_id, verb, Outcome.REFUSED,
                    f"{_label(approval)} waits for its user's approval first (its tool is "
                    "approved by the agent's user, then an operator); nothing was decided",
                    approval.name, approval.effect, approval.queue)
            if approval.state not in (ApprovalState.PENDING, ApprovalState.USER_APPROVED):
                # A decision whose message is not published yet is published
                # now; the decision itself stands.
                decide_approval(self.app, approval, state, by=actor, reason=reason, via=via)
                return ActionResult(
                    task_id, verb, Outcome.REFUSED,
                    f"{_label(approval)} was decided already: {approval.state.value}"
                    + (f" by {approval.decided_by}" if approval.decided_by else ""),
                    approval.name, approval.effect, approval.queue,
                )
            shown = self.arguments(approval)
            if seen is not None and seen != shown.digest:
                return ActionResult(
                    task_id, verb, Outcome.REFUSED,
                    f"{_label(approval)}: what is shown of its arguments changed since it "
                    "was shown to you (another digest); look again, nothing was decided",
                    approval.name, approval.effect, approval.queue)
            move = decide_approval(
                self.app, approval, state, by=actor, reason=reason, via=via,
                shown=shown.audit_details(self.runtime.settings.privacy))
        except STORE_ERRORS as exc:
            return ActionResult(task_id, verb, Outcome.FAILED, f"{task_id}: {exc}")
        except Exception as exc:  # publishing failed: the decision stands, listed
            return ActionResult(
                task_id, verb, Outcome.FAILED,
                f"{task_id}: decided, but its message was not published yet "
                f"({type(exc).__name__}: {exc}); the next sweep publishes it",
            )
        if not move:
            return ActionResult(task_id, verb, Outcome.REFUSED,
                                f"{_label(approval)} was decided meanwhile: "
                                f"{move.previous.value}",
                                approval.name, approval.effect, approval.queue)
        done = "approved: published again" if state is ApprovalState.APPROVED else (
            "rejected: it ends FAILURE (ApprovalRejected) when a worker receives it")
        return ActionResult(task_id, verb, Outcome.DONE, f"{_label(approval)} {done}",
                            approval.name, approval.effect, approval.queue)


def _label(approval: Approval) -> str:
    return f"{approval.name}[{approval.task_id}]"
