"""The audit log: one Redis stream per run, plus a global stream for tailing.

Events of a write are appended by the journal's transition scripts, in the
same atomic step as the transition. Everything else (read-only tools, lease
notes, operator actions) goes through :meth:`AuditLog.record_step`, which never
raises and returns whether the event was stored.

What an event may say about a call's arguments, result and error depends on
the privacy level (``tooleffect_privacy``):

``metadata`` (default)
    only sizes (``args_size``, ``kwargs_size``, ``result_size``, ``error_size``);
``redacted``
    the shape, with every value masked;
``full``
    the values verbatim (truncated at 64 KiB each).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from ..effect import ToolEffect
from ..events import AuditEvent
from ..settings import Settings, settings_for
from .connections import Command, client_for, one_round_trip
from .keys import Keys, unescape_hash_tag
from .leases import BrokerAck
from .lua import KeyOrArg, script

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

MASK = "***"
FULL_VALUE_LIMIT = 64 * 1024

#: This process's identity, and the pid it was computed in (a forked pool
#: process computes its own).
_identity: tuple[int, str] = (0, "")


def worker_identity() -> str:
    """``hostname:pid`` of this process (asked of the system once per process:
    ``gethostname`` is a system call, and every event carries it)."""
    global _identity
    pid = os.getpid()
    if _identity[0] != pid:
        _identity = (pid, f"{socket.gethostname()}:{pid}")
    return _identity[1]


def _safe_text(value: Any, form: Any = repr) -> str:
    """``repr(value)`` (or ``str``), or a placeholder when that raises."""
    try:
        return str(form(value))
    except Exception:
        return f"<{type(value).__qualname__}: unrepresentable>"


def _to_json(value: Any) -> str:
    try:
        return json.dumps(value, default=_safe_text, ensure_ascii=False, separators=(",", ":"))
    except Exception:  # a circular structure, keys JSON cannot take
        return json.dumps(_safe_text(value), ensure_ascii=False)


def _mask(value: Any, depth: int = 0) -> Any:
    if depth > 32:  # a circular or absurdly deep structure
        return MASK
    if isinstance(value, Mapping):
        return {_safe_text(key, str): _mask(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mask(item, depth + 1) for item in value]
    return MASK


def describe_payload(privacy: str, **values: Any) -> dict[str, str]:
    """Event fields that describe ``values`` (args, kwargs, result, error) at ``privacy``.

    An exception is described by its message; its type is always recorded in
    ``exception_type`` by the caller, since the type is metadata.
    """
    fields: dict[str, str] = {}
    for name, value in values.items():
        if value is None:
            continue
        # Never raises: a value whose repr or str raises, a circular structure
        # or keys JSON cannot take are described by a placeholder text.
        is_error = isinstance(value, BaseException)
        text = _safe_text(value, str) if is_error else _to_json(value)
        if privacy == "full":
            fields[name] = text[:FULL_VALUE_LIMIT]
        elif privacy == "redacted":
            try:
                fields[name] = MASK if is_error else _to_json(_mask(value))
            except Exception:
                fields[name] = MASK
        else:
            fields[f"{name}_size"] = str(len(text.encode("utf-8", "replace")))
    return fields


@dataclass(frozen=True)
class StepContext:
    """What every audit event of one attempt shares."""

    run_id: str
    task_id: str
    tool: str
    effect: ToolEffect
    queue: str
    redelivered: bool
    worker: str

    def event(
        self,
        phase: str,
        status: str,
        *,
        attempt: int | None = None,
        duration_ms: float | None = None,
        exception: BaseException | None = None,
        exception_type: str | None = None,
        failure_class: str | None = None,
        payload: Mapping[str, str] | None = None,
        **details: Any,
    ) -> AuditEvent:
        """One event of this attempt; ``payload`` and ``details`` are its details."""
        return AuditEvent.of(
            run_id=self.run_id,
            task_id=self.task_id,
            tool=self.tool,
            effect=self.effect,
            phase=phase,
            status=status,
            worker=self.worker,
            queue=self.queue,
            redelivered=self.redelivered,
            attempt=attempt,
            duration_ms=duration_ms,
            failure_class=failure_class,
            exception=exception,
            exception_type=exception_type,
            **{**(payload or {}), **details},
        )


def flatten(fields: Mapping[str, Any]) -> list[str]:
    """``{"a": 1}`` as ``["a", "1"]``: how scripts receive an event."""
    flat: list[str] = []
    for name, value in fields.items():
        if value is None:
            continue
        flat.append(str(name))
        flat.append(value if isinstance(value, str) else str(value))
    return flat


def text(value: bytes | str) -> str:
    """A Redis reply as text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _decode(fields: Mapping[Any, Any]) -> dict[str, str]:
    return {text(key): text(value) for key, value in fields.items()}


@dataclass(frozen=True)
class ChainCheck:
    """What :meth:`AuditLog.verify` found in one run's stream."""

    run_id: str
    events: int
    #: The first broken link: the stream entry id, and what is wrong with it.
    broken_at: str | None = None
    problem: str | None = None

    @property
    def intact(self) -> bool:
        return self.broken_at is None


def event_hash(fields: Sequence[tuple[bytes, bytes]]) -> str:
    """The hash an event's fields (in stored order, without ``hash``) must carry."""
    canonical = b"".join(
        b"%d:%s" % (len(part), part) for pair in fields for part in pair
    )
    return hashlib.sha1(canonical).hexdigest()


@dataclass(frozen=True)
class StoredResult:
    """Celery's result of a task, as its Redis backend would store it: the key,
    the encoded value, and the expiry in seconds (None: none)."""

    key: str | bytes
    value: str | bytes
    expires: int | None


class AuditLog:
    """Reads and appends a run's audit events."""

    def __init__(self, app: Celery, settings: Settings | None = None) -> None:
        self.settings = settings or settings_for(app)
        self.keys = Keys(self.settings.key_prefix)

    @property
    def client(self) -> redis.Redis:
        return client_for(self.settings.store_endpoint, self.settings.socket_timeout)

    def record_step(self, event: AuditEvent, result: StoredResult | None = None,
                    ack: BrokerAck | None = None) -> bool:
        """Append ``event`` to its run's stream. Never raises; True if stored.

        The copy to the global stream travels in the same round trip.
        ``result`` (the result backend is this Redis): stored and published in
        the same script, so a READ_ONLY call's outcome and its Celery result
        are one round trip; when this returns False the caller must leave the
        result to Celery. ``ack`` (the broker is this Redis): the task's
        message is acknowledged in the same script; when this returns False
        it was not.
        """
        try:
            run_id = str(event["run_id"])
            fields = flatten(event)
            script("append_event").call_with(
                self.client,
                [self.keys.run_events(run_id), self.keys.run_seq(run_id),
                 *([result.key] if result is not None else []),
                 *((ack.unacked_key, ack.index_key) if ack is not None else ())],
                [self.settings.run_stream_maxlen, self.settings.journal_ttl,
                 (result.expires or 0) if result is not None else 0,
                 result.value if result is not None else "",
                 ack.tag if ack is not None else "", *fields],
                also=[self.global_copy(fields)],
            )
        except Exception as exc:
            logger.warning("audit event not stored (%s: %s): %s", type(exc).__name__, exc,
                           dict(event, run_id=event.get("run_id")))
            return False
        return True

    def record_steps(self, events: Sequence[AuditEvent]) -> list[bool]:
        """:meth:`record_step` for many events, in one round trip with their
        global-stream copies; each append stays atomic. Never raises; True
        where stored."""
        try:
            flat = [flatten(event) for event in events]
            calls: list[tuple[list[KeyOrArg], list[KeyOrArg]]] = []
            for event, fields in zip(events, flat, strict=True):
                run_id = str(event["run_id"])
                calls.append(([self.keys.run_events(run_id), self.keys.run_seq(run_id)],
                              [self.settings.run_stream_maxlen, self.settings.journal_ttl,
                               0, "", "", *fields]))
            answers = script("append_event").call_many(
                self.client, calls, also=[self.global_copy(fields) for fields in flat])
        except Exception as exc:
            logger.warning("%d audit events not stored (%s: %s)", len(events),
                           type(exc).__name__, exc)
            return [False] * len(events)
        stored = [not isinstance(answer, Exception) for answer in answers]
        for event, ok, answer in zip(events, stored, answers, strict=True):
            if not ok:
                logger.warning("audit event not stored (%s): %s", answer,
                               dict(event, run_id=event.get("run_id")))
        return stored

    def global_copy(self, fields: Sequence[str]) -> Command:
        """The command that copies an event, given as its :func:`flatten` fields, to
        the global stream used for tailing."""
        return ("XADD", self.keys.global_events, "MAXLEN", "~",
                self.settings.global_stream_maxlen, "*", *fields)

    def copy_to_global(self, event: AuditEvent) -> None:
        """Copy an event to the global stream used for tailing. Best effort."""
        try:
            one_round_trip(self.client, [self.global_copy(flatten(event))])
        except Exception as exc:
            logger.debug("global audit copy skipped: %s", exc)

    def events(self, run_id: str) -> list[AuditEvent]:
        """The events of ``run_id`` in the order they were stored, oldest first.

        Each is an :class:`AuditEvent` read back (:meth:`AuditEvent.from_stream`):
        typed attributes (``ts``, ``attempt``, ``duration_ms``, ``redelivered``,
        the chain's ``seq``, ``prev``, ``hash``, and ``entry_id``), and the
        mapping of its stored fields' text with its stream entry ``id``
        (``event["status"]``, ``dict(event)``). Reads only that run's stream.
        """
        entries: Sequence[Any] = self.client.xrange(self.keys.run_events(run_id)) or []
        return [AuditEvent.from_stream(text(entry_id), _decode(fields))
                for entry_id, fields in entries]

    def verify(self, run_id: str) -> ChainCheck:
        """Check the hash chain of ``run_id``'s events; report the first broken link.

        An edited event no longer matches its ``hash``; a deleted one leaves
        the next event's ``prev`` pointing at nothing. The chain head kept
        beside the stream catches the deletion of the newest events. Events
        trimmed by MAXLEN are not a break: checking starts at the oldest event
        still stored.
        """
        client = self.client
        entries: Sequence[Any] = client.xrange(self.keys.run_events(run_id)) or []
        head = client.hget(self.keys.run_seq(run_id), "head")
        previous: str | None = None
        for entry_id, raw in entries:
            pairs = [(bytes(key), bytes(value)) for key, value in raw.items()]
            stored = dict(pairs)
            where = text(entry_id)
            if not pairs or pairs[-1][0] != b"hash":
                return ChainCheck(run_id, len(entries), where, "event has no hash")
            if event_hash(pairs[:-1]) != text(stored[b"hash"]):
                return ChainCheck(run_id, len(entries), where, "event was altered")
            if previous is not None and text(stored.get(b"prev", b"")) != previous:
                return ChainCheck(run_id, len(entries), where,
                                  "the event before it is missing or was altered")
            previous = text(stored[b"hash"])
        if head is not None and previous != text(head):
            where = text(entries[-1][0]) if entries else "end"
            return ChainCheck(run_id, len(entries), where, "newer events were deleted")
        return ChainCheck(run_id, len(entries))

    def runs(self) -> Iterator[str]:
        """Every run id that has an audit stream (scans the store: for operators)."""
        pattern = f"{self.keys.prefix}{{*}}:events"
        for key in self.client.scan_iter(match=pattern, count=1000):
            name = text(key)[len(self.keys.prefix):]
            yield unescape_hash_tag(name[1:name.rindex("}:events")])

    def tail(self, count: int = 100) -> list[AuditEvent]:
        """The newest ``count`` events of all runs, oldest first, read back as
        :meth:`events` reads them (``entry_id`` and ``id`` are the global
        stream's; a copy there carries no chain: ``seq``, ``prev`` and ``hash``
        are None unless the copy holds them)."""
        entries: Sequence[Any] = self.client.xrevrange(self.keys.global_events, count=count) or []
        return [AuditEvent.from_stream(text(entry_id), _decode(fields))
                for entry_id, fields in reversed(entries)]
