"""``Runs(app)``: what operators see of one agent run, every call of it in
order (:class:`~celery_tooleffect.store.runs.RunCalls`), for ``celery
tooleffect runs show`` and Flower's run page, and the timeline the page draws.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..store.runs import CallSummary, RunCalls, RunPage
from ..store.runtime import runtime_for

if TYPE_CHECKING:
    from celery import Celery

#: Calls per page of the run page, ``runs show`` and ``GET /api/runs/<run_id>``.
PAGE_SIZE = 200

#: The colour class of a call's state on the page (Bootstrap's text-bg-*).
STATE_COLOURS = {
    "succeeded": "success", "failed": "danger", "dead_lettered": "danger",
    "rejected": "secondary", "revoked": "secondary", "not_run": "secondary",
    "purged": "secondary", "interrupted": "warning", "retrying": "warning",
    "awaiting_approval": "info", "running": "primary", "queued": "light",
    "replayed": "info", "reconciled": "info",
}


@dataclass(frozen=True)
class Bar:
    """One bar of the timeline: a call's attempt, or the wait around it, in
    per cent of the page's time axis."""

    row: int
    left: float
    width: float
    #: ``span`` (a body that ran) or ``life`` (first to last event).
    kind: str
    status: str


class Runs:
    """The calls of an app's runs, as their audit events tell them."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.runtime = runtime_for(app)
        self.calls = RunCalls(self.runtime.audit)

    def page(self, run_id: str, *, cursor: str | None = None,
             limit: int = PAGE_SIZE) -> RunPage:
        """``limit`` calls of ``run_id`` from ``cursor``, in the order they started."""
        return self.calls.page(run_id, cursor=cursor, limit=limit)


def timeline(calls: list[CallSummary]) -> tuple[list[Bar], float, float]:
    """The bars of ``calls`` on one time axis, and the axis's start and length
    in seconds (at least one millisecond)."""
    if not calls:
        return [], 0.0, 0.001
    start = min(call.first_ts for call in calls)
    end = max(max([call.last_ts, *(span_end or 0.0 for _, span_end, _ in call.spans)])
              for call in calls)
    length = max(end - start, 0.001)

    def at(ts: float) -> float:
        return round((ts - start) / length * 100, 3)

    bars: list[Bar] = []
    for row, call in enumerate(calls):
        bars.append(Bar(row, at(call.first_ts), max(at(call.last_ts) - at(call.first_ts), 0.2),
                        "life", call.state))
        for span_start, span_end, status in call.spans:
            finish = span_end if span_end is not None else call.last_ts
            bars.append(Bar(row, at(span_start), max(at(finish) - at(span_start), 0.4), "span",
                            status))
    return bars, start, length


def link_of(call: CallSummary) -> tuple[str, str]:
    """Where a call's task id leads on Flower: ``(url name, task id)``; the
    dead letter or the approval the call became, else Flower's task page."""
    if call.state == "dead_lettered" or call.dead_letter_reason:
        return "dead_letter", call.task_id
    if call.approval:
        return "approval", call.task_id
    return "task", call.task_id


def caller_label(caller: str) -> str:
    """Who made a call, for a person: its ``tooleffect_caller`` header (the
    JSON the MCP server sets) as a short text: an OAuth token's subject (or
    client id) and issuer, ``static token``, ``stdio``, ``no token``; '—'
    when the call names nobody, the text itself when it is not that JSON."""
    if not caller:
        return "—"
    try:
        named = json.loads(caller)
    except ValueError:
        return caller
    if not isinstance(named, dict):
        return caller
    auth = named.get("auth")
    if auth == "oauth":
        who = named.get("sub") or named.get("client_id") or "?"
        return f"{who} ({named['iss']})" if named.get("iss") else str(who)
    return {"static-token": "static token", "stdio": "stdio", "none": "no token"}.get(
        str(auth), caller)


def caller_of_events(events: list[Mapping[str, Any]]) -> str:
    """The caller the first of ``events`` that names one records ('' if none)."""
    return next((str(event["caller"]) for event in events if event.get("caller")), "")


__all__ = ["PAGE_SIZE", "STATE_COLOURS", "Bar", "Runs", "caller_label", "caller_of_events",
           "link_of", "timeline"]
