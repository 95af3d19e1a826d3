"""A run's calls, read from its audit events one page at a time.

A run's events (:meth:`Keys.run_events`, a list: :mod:`.chain`) are every
event of every call of the run, in the order they were stored.
:meth:`RunCalls.page` groups them by task id into :class:`CallSummary`
records, in the order each call first appears, ``limit`` calls a page. A page
starts at an event's ``seq`` (its cursor: the first event of its first call)
and reads the list from there in chunks, so its cost is bounded whatever the
run's length: it stops once it holds ``limit`` calls and has read
``lookahead`` more events for their later events (a call's outcome comes
after other calls' intents), or at ``max_events``. A call whose events go
on past what a page read is marked ``partial``; the next page, which starts
at the first call not shown, never shows a call twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .audit import AuditLog
from .chain import Element, Header, stored

#: Events read per LRANGE.
CHUNK = 1000


@dataclass
class CallSummary:
    """One call of a run, as its audit events tell it."""

    task_id: str
    tool: str = ""
    effect: str = ""
    queue: str = ""
    #: Unix seconds of its first and last event.
    first_ts: float = 0.0
    last_ts: float = 0.0
    #: The highest attempt number an event names (0: none named one); a
    #: replay starts the numbers again, :attr:`bodies` counts every run.
    attempts: int = 0
    #: Each attempt's body as ``(start, end, status)`` in unix seconds
    #: (``end`` None while it runs, or when it never reported).
    spans: list[tuple[float, float | None, str]] = field(default_factory=list)
    #: ``phase status`` of its last event.
    last: str = ""
    #: Where it stands: ``succeeded``, ``failed``, ``retrying``, ``running``,
    #: ``dead_lettered``, ``awaiting_approval``, ``rejected``, ``revoked``,
    #: ``not_run``, ``replayed``, ``purged`` or its last ``phase status``.
    state: str = ""
    failure_class: str = ""
    exception_type: str = ""
    dead_letter_reason: str = ""
    #: The approval's last status (``requested``, ``approved``, ...), if it had one.
    approval: str = ""
    #: Who made the call: its ``tooleffect_caller`` header as its events
    #: record it (compact JSON; '' when it names nobody).
    caller: str = ""
    events: int = 0
    #: Its events go on past what the page read.
    partial: bool = False

    @property
    def bodies(self) -> int:
        """How many times its body started: every attempt, and every run after
        a replay (whose attempt numbers start again at 1), counted."""
        return len(self.spans)

    @property
    def duration_ms(self) -> float:
        """Milliseconds its bodies ran, summed over the attempts that reported."""
        return sum((end - start) * 1000 for start, end, _ in self.spans if end is not None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: ``runs show --json`` and ``GET /api/runs/<run_id>``."""
        return {
            "task_id": self.task_id, "tool": self.tool, "effect": self.effect,
            "queue": self.queue, "state": self.state, "last": self.last,
            "first_ts": self.first_ts, "last_ts": self.last_ts, "attempts": self.attempts,
            "bodies": self.bodies,
            "duration_ms": round(self.duration_ms, 3),
            "spans": [{"start": start, "end": end, "status": status}
                      for start, end, status in self.spans],
            "failure_class": self.failure_class or None,
            "exception_type": self.exception_type or None,
            "dead_letter_reason": self.dead_letter_reason or None,
            "approval": self.approval or None, "caller": self.caller or None,
            "events": self.events,
            "partial": self.partial,
        }

    def add(self, event: Mapping[str, str]) -> None:
        """Take one more of its events (in stored order) into account."""
        ts = _number(event.get("ts"))
        if not self.events:
            self.first_ts = ts
        self.events += 1
        self.last_ts = max(self.last_ts, ts)
        for name in ("tool", "effect", "queue", "caller"):
            if event.get(name) and not getattr(self, name):
                setattr(self, name, event[name])
        attempt = int(_number(event.get("attempt")))
        self.attempts = max(self.attempts, attempt)
        phase, status = event.get("phase", ""), event.get("status", "")
        self.last = f"{phase} {status}".strip()
        if (phase, status) == ("outcome", "succeeded"):
            # How an earlier run ended (before a replay) is not how this one did.
            self.failure_class = self.exception_type = self.dead_letter_reason = ""
        if event.get("failure_class"):
            self.failure_class = event["failure_class"]
        if event.get("exception_type"):
            self.exception_type = event["exception_type"]
        if event.get("dead_letter_reason"):
            self.dead_letter_reason = event["dead_letter_reason"]
        if phase == "intent" and status == "started":
            self.spans.append((ts, None, "running"))
        elif phase == "outcome":
            self._close(ts, status, _number(event.get("duration_ms")) / 1000)
        elif phase == "interrupted":
            self._close(ts, "interrupted", 0.0)
        elif phase == "approval":
            self.approval = status
        elif phase == "dead_lettered":  # its status is the dead-letter reason
            self.dead_letter_reason = status
        self.state = _state(phase, status, self.state)

    def _close(self, ts: float, status: str, took: float) -> None:
        """End the open span (a write's intent), or add the read's: its
        outcome event carries how long the body took."""
        if self.spans and self.spans[-1][1] is None:
            start = self.spans[-1][0]
            self.spans[-1] = (start, ts, status)
        elif took > 0 or status in ("succeeded", "failed", "retrying"):
            self.spans.append((ts - took, ts, status))


#: (phase, status) -> state; a phase alone matches any status.
_STATES: dict[tuple[str, str], str] = {
    ("outcome", "succeeded"): "succeeded",
    ("outcome", "failed"): "failed",
    ("outcome", "retrying"): "retrying",
    ("outcome", "revoked"): "revoked",
    ("outcome", "not_run"): "not_run",
    ("intent", "started"): "running",
    ("approval", "requested"): "awaiting_approval",
    ("approval", "approved"): "queued",
    ("approval", "rejected"): "rejected",
    ("approval", "expired"): "rejected",
    ("dead_lettered", ""): "dead_lettered",
    ("replayed", ""): "replayed",
    ("purged", ""): "purged",
    ("interrupted", ""): "interrupted",
    ("reconciled", ""): "reconciled",
}


def _state(phase: str, status: str, before: str) -> str:
    found = _STATES.get((phase, status)) or _STATES.get((phase, ""))
    if found is None:
        # Events that say nothing of where the call stands (a deferral, a
        # refused lease, a duplicate ignored) leave it as it was.
        return before or f"{phase} {status}".strip()
    if before == "dead_lettered" and found in ("failed", "interrupted"):
        return before
    return found


@dataclass(frozen=True)
class RunPage:
    """One page of a run's calls."""

    run_id: str
    calls: list[CallSummary]
    #: The cursor of the next page; None on the last.
    next_cursor: str | None
    #: Events this page read (its cost).
    events_read: int

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "calls": [call.to_dict() for call in self.calls],
                "next_cursor": self.next_cursor, "events_read": self.events_read}


class RunCalls:
    """Reads a run's calls from its audit events (:class:`AuditLog`'s store)."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def page(self, run_id: str, *, cursor: str | None = None, limit: int = 200,
             lookahead: int = 2000, max_events: int = 20_000) -> RunPage:
        """``limit`` calls of ``run_id`` from ``cursor`` (an event's seq; None, or
        one no longer stored: the first kept), in the order they first appear
        (see the module docs)."""
        client = self.audit.client
        key = self.audit.keys.run_events(run_id)
        calls: dict[str, CallSummary] = {}
        wanted = _seq(cursor)
        next_cursor: str | None = None
        read = 0
        past_limit = 0
        exhausted = False
        while read < max_events:
            # The header first: trimming moves where a seq is.
            first = stored([client.lindex(key, 0) or b""])[0]
            header = Header.parse(first)
            base = header.base_seq if header is not None else 0
            start = max(wanted - base, 1) if wanted else 1
            # And the event before: an outcome takes its task from it.
            entries = stored(client.lrange(key, max(start - 1, 1), start + CHUNK - 1))
            element = Element.parse(0, entries.pop(0)) if start > 1 and entries else None
            if not entries:
                exhausted = True
                break
            for number, raw in enumerate(entries, base + start):
                read += 1
                element = Element.parse(number, raw, element)
                event = element.fields(run_id)
                task_id = event.get("task_id", "")
                if task_id not in calls:
                    if len(calls) >= limit:
                        if next_cursor is None:
                            next_cursor = str(number)
                        past_limit += 1
                        continue
                    calls[task_id] = CallSummary(task_id)
                elif next_cursor is not None:
                    past_limit += 1
                calls[task_id].add(event)
            wanted = base + start + len(entries)
            if len(entries) < CHUNK:
                exhausted = True
                break
            if next_cursor is not None and past_limit >= lookahead:
                break
        if not exhausted:
            for call in calls.values():
                if call.state in ("running", "queued", "awaiting_approval", "retrying", ""):
                    call.partial = True
            if next_cursor is None:  # max_events read inside this page's calls
                next_cursor = str(wanted) if read else None
        return RunPage(run_id, list(calls.values()), next_cursor, read)


def _seq(cursor: str | None) -> int:
    """The seq a cursor names (0: none, or not a seq)."""
    try:
        return max(int(cursor or 0), 0)
    except ValueError:
        return 0


def _number(value: Any) -> float:
    try:
        return float(value) if value not in (None, "") else 0.0
    except (TypeError, ValueError):
        return 0.0
