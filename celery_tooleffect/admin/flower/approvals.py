"""The Approvals tab and its JSON API.

Pages: ``/approvals`` (the parked calls, with filters and paging),
``/approvals/<task_id>`` (one call, with its Approve and Reject forms) and
``POST /approvals/<task_id>/(approve|reject)`` (the forms). API: ``GET
/api/approvals`` (one page, as ``approvals list --json``:
:meth:`~celery_tooleffect.admin.approvals.ApprovalListing.to_dict`),
``/api/approvals/stats``, ``/api/approvals/<task_id>`` and ``POST
/api/approvals/<task_id>/(approve|reject)``. The decisions are
:class:`~celery_tooleffect.admin.approvals.Approvals`', under the request
checks of :mod:`.security`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from flower.api import BaseApiHandler
from flower.views import BaseHandler
from tornado import web
from tornado.web import url

from ...states import ApprovalState
from ...store.approvals import Approval
from ..approvals import ApprovalListing, Approvals
from ..filters import approval_state
from ..operations import STORE, ActionResult, Outcome
from ..runs import caller_label, caller_of_events
from ..visible import escape, visible_json, warning
from .handlers import HTTP_STATUS, ToolEffectHandler, limit_of, offset_of, pretty

#: Parked calls per page on the Approvals page and of ``GET /api/approvals``
#: (``?limit=`` changes it, up to 500).
PAGE_SIZE = 50


def handlers() -> list[Any]:
    """The Approvals page's and API's URL rules (without Flower's URL prefix)."""
    return [
        url(r"/approvals", ApprovalsPage, name="approvals"),
        url(r"/approvals/([^/]+)", ApprovalPage, name="approval"),
        url(r"/approvals/([^/]+)/(approve|reject)", ApprovalActionPage,
            name="approval_action"),
        (r"/api/approvals", ApprovalsApi),
        (r"/api/approvals/stats", ApprovalStatsApi),
        (r"/api/approvals/([^/]+)", ApprovalApi),
        (r"/api/approvals/([^/]+)/(approve|reject)", ApprovalActionApi),
    ]


class _ApprovalHandler(ToolEffectHandler):
    """What the Approvals page and API share: the operations and the list's filters."""

    get_argument: Callable[..., Any]

    @property
    def approvals(self) -> Approvals:
        return self.application.tooleffect_approvals  # type: ignore[no-any-return]

    def approval_filters(
        self, get: Callable[..., Any]
    ) -> tuple[str | None, str | None, ApprovalState | None]:
        """The list's filters: ``queue``, ``tool`` and ``state`` (400 for an unknown state)."""
        try:
            wanted = approval_state(get("state", ""))
        except ValueError as exc:
            raise web.HTTPError(400, str(exc)) from None
        return get("queue", "") or None, get("tool", "") or None, wanted

    def wanted(self) -> dict[str, Any]:
        """The page the request asks for: :meth:`Approvals.page`'s arguments (400 for an
        unknown state, or a limit or offset that is not a number)."""
        get = functools.partial(self.get_argument, escape=False)
        queue, tool, state = self.approval_filters(get)
        return {"queue": queue, "tool": tool, "state": state,
                "limit": limit_of(get("limit", ""), PAGE_SIZE),
                "offset": offset_of(get("offset", ""))}

    async def decide(self, task_id: str, verb: str, reason: str,
                     seen: str | None = None) -> ActionResult:
        """Approve or reject ``task_id`` as the logged-in user, once the store answers
        (else 503, nothing decided); a rejection needs a reason. ``seen``: the
        digest of the arguments the page showed (refused if they changed)."""
        await self.require(STORE)
        return await self.blocking(_decide, self.approvals, task_id, verb,
                                   by=self.actor(), reason=reason.strip(), seen=seen)


def _decide(approvals: Approvals, task_id: str, verb: str, *, by: str,
            reason: str, seen: str | None = None) -> ActionResult:
    if verb == "reject" and not reason:
        approval = approvals.get(task_id)
        if approval is None:
            return ActionResult(task_id, verb, Outcome.NOT_FOUND,
                                f"{task_id}: no call waits for approval under this id")
        return ActionResult(task_id, verb, Outcome.REFUSED,
                            f"{approval.name}[{task_id}]: a rejection needs a reason "
                            "(written in the audit log); nothing was decided",
                            approval.name, approval.effect, approval.queue)
    if verb == "approve":
        return approvals.approve(task_id, by=by, reason=reason, via="flower", seen=seen)
    return approvals.reject(task_id, by=by, reason=reason, via="flower", seen=seen)


def _age(seconds: float) -> str:
    """How long a call has waited, for people: ``42 s``, ``5 min``, ``3 h 5 min``, ``2 d 3 h``."""
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds} s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 3600:
        return f"{minutes} min"
    if seconds < 86400:
        return f"{hours} h {minutes % 60} min"
    return f"{days} d {hours % 24} h"


_APPROVAL_STATE_BADGES = {
    ApprovalState.PENDING: "text-bg-warning", ApprovalState.USER_APPROVED: "text-bg-info",
    ApprovalState.APPROVED: "text-bg-success",
    ApprovalState.REJECTED: "text-bg-danger", ApprovalState.EXPIRED: "text-bg-secondary",
    ApprovalState.ENDED: "text-bg-dark", ApprovalState.ABSENT: "text-bg-light",
}


def _state_badge(approval: Approval) -> str:
    return _APPROVAL_STATE_BADGES.get(approval.state, "text-bg-secondary")


# -- the page ----------------------------------------------------------------------


class _ApprovalPages(_ApprovalHandler, BaseHandler):  # type: ignore[misc]
    """Renders the Approvals list and one call's page."""

    async def render_list(self) -> None:
        wanted = self.wanted()
        queue, tool, state = wanted["queue"], wanted["tool"], wanted["state"]
        stats = await self.blocking(self.approvals.stats)
        page: ApprovalListing = await self.blocking(self.approvals.listing, **wanted)
        shown = await self.blocking(lambda: {approval.task_id: self.approvals.arguments(approval)
                                             for approval in page.approvals})
        self.render(
            "tooleffect_approvals.html",
            approvals=page.approvals,
            shown=shown,
            total=page.total,
            offset=page.offset,
            limit=page.limit,
            next_offset=page.next_offset,
            stats=stats,
            queues=sorted(set(stats["by_queue"]) | ({queue} if queue else set())),
            tools=sorted(set(stats["by_tool"]) | ({tool} if tool else set())),
            queue=queue or "",
            tool=tool or "",
            state=state.value if state is not None else "",
            now=time.time(),
            age=_age,
            badge=_state_badge,
            shown_json=visible_json,
            shown_text=escape,
        )

    async def render_detail(
        self, task_id: str, result: ActionResult | None = None, status: int = 200
    ) -> None:
        approval = await self.blocking(self.approvals.get, task_id)
        if approval is None and result is None:
            raise web.HTTPError(404, f"No call waits for approval under {task_id!r}")
        events: list[Any] = []
        shown = None
        if approval is not None:
            run_events = await self.blocking(self.approvals.runtime.audit.events,
                                             approval.run_id)
            events = [event for event in run_events if event.get("task_id") == task_id]
            shown = await self.blocking(self.approvals.arguments, approval)
        self.set_status(status)
        self.render(
            "tooleffect_approval.html",
            task_id=task_id,
            approval=approval,
            shown=shown,
            events=events,
            caller=caller_label(caller_of_events(events)),
            result=result,
            now=time.time(),
            age=_age,
            badge=_state_badge,
            pretty=pretty,
            warning=warning,
        )


class ApprovalsPage(_ApprovalPages):
    """``/approvals``: the parked calls, with filters and paging."""

    @web.authenticated
    async def get(self) -> None:
        await self.render_list()


class ApprovalPage(_ApprovalPages):
    """``/approvals/<task_id>``: one call, with its Approve and Reject forms."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        await self.render_detail(task_id)


class ApprovalActionPage(_ApprovalPages):
    """``POST /approvals/<task_id>/(approve|reject)`` from the page's forms."""

    @web.authenticated
    async def post(self, task_id: str, verb: str) -> None:
        self.refuse_cross_origin()
        self.check_xsrf_token()
        reason = self.get_argument("reason", "", escape=False) or ""
        seen = self.get_argument("shown_digest", "", escape=False) or None
        result = await self.decide(task_id, verb, reason, seen)
        await self.render_detail(task_id, result, HTTP_STATUS[result.outcome])


# -- the API -----------------------------------------------------------------------


class ApprovalsApi(_ApprovalHandler, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/approvals``: one page of the listed calls, oldest first, as
    ``approvals list --json`` with paging (:meth:`ApprovalListing.to_dict`: ``count``
    on this page, ``next_offset`` null on the last page, ``total`` every call the
    filters match)."""

    @web.authenticated
    async def get(self) -> None:
        page = await self.blocking(self.approvals.listing, **self.wanted())
        self.write(page.to_dict(paging=True))


class ApprovalStatsApi(_ApprovalHandler, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/approvals/stats``: pending calls by queue and tool."""

    @web.authenticated
    async def get(self) -> None:
        self.write(await self.blocking(self.approvals.stats))


class ApprovalApi(_ApprovalHandler, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/approvals/<task_id>``: the call's record, pending or decided."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        approval = await self.blocking(self.approvals.get, task_id)
        if approval is None:
            raise web.HTTPError(404, f"No call waits for approval under {task_id!r}")
        shown = await self.blocking(self.approvals.arguments, approval)
        self.write({**approval.to_dict(), "shown": shown.to_dict()})


class ApprovalActionApi(_ApprovalHandler, BaseApiHandler):  # type: ignore[misc]
    """``POST /api/approvals/<task_id>/(approve|reject)``: one result as JSON."""

    @web.authenticated
    async def post(self, task_id: str, verb: str) -> None:
        self.refuse_cross_origin()
        body = self.json_body()
        seen = body.get("shown_digest")
        result = await self.decide(task_id, verb, str(body.get("reason") or ""),
                                   str(seen) if seen else None)
        self.set_status(HTTP_STATUS[result.outcome])
        self.write(result.to_dict())
