"""The audit log: one Redis list per run (:mod:`.chain`), plus a global stream for tailing.

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

import json
import logging
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import redis

from ..effect import ToolEffect
from ..events import AuditEvent
from ..settings import Settings, settings_for
from .chain import ChainCheck, Element, Header, check_chain, head_of, link, seal, stored
from .connections import Command, client_for, one_round_trip
from .keys import store_keys, unescape_hash_tag
from .leases import BrokerAck
from .lua import KeyOrArg, databases_argument, script

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
    #: Who made the call (its ``tooleffect_caller`` header; '' when it names
    #: nobody): every event of the attempt records it as ``details.caller``.
    caller: str = ""

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
            **{**(payload or {}), **details,
               **({"caller": self.caller} if self.caller else {})},
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


#: The fields an event's copy in the global stream keeps: what ``audit tail``
#: shows (and the sizing's call rate reads); its time is the entry id's. The
#: run's list holds the rest.
GLOBAL_FIELDS = frozenset(("run_id", "task_id", "tool", "phase", "status",
                           "failure_class", "worker", "actor"))


def copied_fields(entry_id: str, fields: Mapping[Any, Any]) -> dict[str, str]:
    """An event's copy in the global stream, entry ``entry_id``, as text: its run
    id first (a copy leaves it out when it is the task id: a call that is a
    run of its own), and its time, the entry id's (milliseconds)."""
    decoded = _decode(fields)
    if "run_id" not in decoded and "task_id" in decoded:
        decoded = {"run_id": decoded["task_id"], **decoded}
    if "ts" not in decoded:
        milliseconds = entry_id.partition("-")[0]
        if milliseconds.isdigit():
            decoded["ts"] = f"{int(milliseconds) / 1000:.3f}"
    return decoded


def entry_order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as (milliseconds, sequence), to merge several streams."""
    milliseconds, _, sequence = text(entry_id).partition("-")
    return int(milliseconds or 0), int(sequence or 0)


def newest_copies(client: Any, streams: Sequence[str], count: int) -> list[Any]:
    """The newest ``count`` entries of the global copy over ``streams``, newest
    first, as ``XREVRANGE`` gives them: one stream read as is, several (a
    cluster's shards) read in one pipeline and merged by entry id. Entry ids
    of streams on different nodes follow each node's clock, so the merged
    order is as good as the nodes' clocks agree."""
    if len(streams) == 1:
        return list(client.xrevrange(streams[0], count=count) or [])
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xrevrange(stream, count=count)
    merged = [entry for entries in pipe.execute() for entry in entries or []]
    merged.sort(key=lambda entry: entry_order(entry[0]), reverse=True)
    return merged[:count]


def read_run(run_id: str, raw: Sequence[bytes]) -> Iterator[AuditEvent]:
    """The events of a run's list ``raw`` (header first), read back: each its
    ``seq`` (also its ``id``), its fields, and the chain's links before and
    after it (``prev``, ``hash``) as computed from what is stored."""
    header = Header.parse(raw[0]) if raw else None
    elements = raw[1:] if header is not None else raw
    base_seq, previous = (header.base_seq, header.base) if header is not None else (0, "")
    element: Element | None = None
    for number, element_bytes in enumerate(elements, 1):
        element = Element.parse(base_seq + number, element_bytes, element)
        current = link(previous, element.body)
        seq = str(element.seq)
        yield AuditEvent.from_stream(seq, {"seq": seq, **element.fields(run_id),
                                           "prev": previous, "hash": current})
        previous = current


@dataclass(frozen=True)
class StoredResult:
    """Celery's result of a task, as its Redis backend would store it: the key,
    the encoded value, and the expiry in seconds (None: none)."""

    key: str | bytes
    value: str | bytes
    expires: int | None
    #: The backend's database when it is not the store's (the script selects
    #: it for the result); None when it is the store's.
    db: int | None = None


class AuditLog:
    """Reads and appends a run's audit events."""

    def __init__(self, app: Celery, settings: Settings | None = None) -> None:
        self.settings = settings or settings_for(app)
        self.keys = store_keys(self.settings.key_prefix,
                               cluster=self.settings.store_endpoint.cluster)

    @property
    def client(self) -> redis.Redis:
        return client_for(self.settings.store_endpoint, self.settings.socket_timeout)

    @cached_property
    def _store_db(self) -> int:
        return self.settings.store_endpoint.db

    def record_step(self, event: AuditEvent, result: StoredResult | None = None,
                    ack: BrokerAck | None = None) -> bool:
        """Append ``event`` to its run's events. Never raises; True if stored.

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
            fields = self.sealed(event)
            script("append_event").call_with(
                self.client,
                [self.keys.run_events(run_id),
                 *([result.key] if result is not None else []),
                 *((ack.unacked_key, ack.index_key) if ack is not None else ())],
                [self.settings.run_stream_maxlen, self.settings.journal_ttl,
                 (result.expires or 0) if result is not None else 0,
                 result.value if result is not None else "",
                 ack.tag if ack is not None else "",
                 databases_argument(self._store_db,
                                    result.db if result is not None else None,
                                    ack.db if ack is not None else None),
                 *fields],
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
            flat = [self.sealed(event) for event in events]
            calls: list[tuple[list[KeyOrArg], list[KeyOrArg]]] = []
            for event, fields in zip(events, flat, strict=True):
                run_id = str(event["run_id"])
                calls.append(([self.keys.run_events(run_id)],
                              [self.settings.run_stream_maxlen, self.settings.journal_ttl,
                               0, "", "", "", *fields]))
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

    def sealed(self, event: AuditEvent) -> list[str]:
        """``event`` as a script receives it (:func:`flatten`), with its keyed MAC
        last when ``tooleffect_audit_key`` is set (:func:`.chain.seal`)."""
        fields = flatten(event)
        key = self.settings.audit_key
        if key is not None:
            fields += ["mac", seal(key, str(event["run_id"]), fields)]
        return fields

    def global_copy(self, fields: Sequence[str]) -> Command:
        """The command that copies an event, given as its :func:`flatten` fields, to
        the global stream used for tailing: only :data:`GLOBAL_FIELDS`."""
        kept: list[str] = []
        for at in range(0, len(fields) - 1, 2):
            if fields[at] in GLOBAL_FIELDS:
                kept += fields[at:at + 2]
        if kept[:1] == ["run_id"] and kept[2:3] == ["task_id"] and kept[1] == kept[3]:
            # A call that is a run of its own: its run id is its task id (read
            # back by copied_fields).
            del kept[:2]
        run_id = next((fields[at + 1] for at in range(0, len(fields) - 1, 2)
                       if fields[at] == "run_id"), "")
        return ("XADD", self.keys.global_stream(run_id), "MAXLEN", "~",
                self._global_maxlen, "*", *kept)

    @cached_property
    def _global_maxlen(self) -> int:
        # The cap is the global copy's, shared by a cluster's shards.
        return max(self.settings.global_stream_maxlen // len(self.keys.global_streams), 1)

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
        the chain's ``seq``, ``prev``, ``hash`` and ``mac``, and ``entry_id``, its
        seq as text), and the mapping of its fields' text with its ``id``
        (``event["status"]``, ``dict(event)``). Reads only that run's list.
        """
        return list(read_run(run_id, stored(
            self.client.lrange(self.keys.run_events(run_id), 0, -1))))

    def verify(self, run_id: str, *, head: tuple[int, str] | None = None) -> ChainCheck:
        """Check the chain of ``run_id``'s events; report the first broken link.

        With ``tooleffect_audit_key`` set, every event's MAC is checked too;
        ``head`` is a head exported earlier (:meth:`head`): the chain must
        still lead to it. What each check finds, and what none can, is in
        docs/operations.md#audit-verify. Events trimmed by
        ``tooleffect_run_stream_maxlen`` are not a break: checking starts at
        the header's base.
        """
        raw = stored(self.client.lrange(self.keys.run_events(run_id), 0, -1))
        return check_chain(run_id, raw, key=self.settings.audit_key, exported=head)

    def head(self, run_id: str) -> tuple[int, str] | None:
        """The run's head, its newest event's ``(seq, link)``, to keep outside
        Redis; None when the run has no events."""
        header = self.client.lindex(self.keys.run_events(run_id), 0)
        return head_of(stored([header])) if header is not None else None

    def runs(self) -> Iterator[str]:
        """Every run id that has audit events (scans the store: for operators)."""
        pattern = f"{self.keys.prefix}{{*}}:events"
        for key in self.client.scan_iter(match=pattern, count=1000):
            name = text(key)[len(self.keys.prefix):]
            yield unescape_hash_tag(name[1:name.rindex("}:events")])

    def tail(self, count: int = 100) -> list[AuditEvent]:
        """The newest ``count`` events of all runs, oldest first, as the global
        stream copies them (:data:`GLOBAL_FIELDS`; ``entry_id`` and ``id`` are
        the global stream's; a copy carries no chain: ``seq``, ``prev`` and
        ``hash`` are None)."""
        entries = newest_copies(self.client, self.keys.global_streams, count)
        return [AuditEvent.from_stream(text(entry_id), copied_fields(text(entry_id), fields))
                for entry_id, fields in reversed(entries)]
