"""Audit events: the typed, frozen record of one step of a tool call.

Every event the package stores (by a worker, in the same atomic step as a
journal transition, or by an operator's action) is an :class:`AuditEvent`,
built by :meth:`AuditEvent.of` or, for an attempt, by ``StepContext.event``.
Stored, it is a flat list of text fields, in this order, the
empty ones left out:

==================  ==========================================================
``run_id``          the agent run the call belongs to
``task_id``         the Celery task id
``tool``            the task's name
``effect``          ``read_only``, ``idempotent_write`` or ``non_idempotent_write``
``phase``           what happened: ``intent``, ``outcome``, ``interrupted``,
                    ``deferred``, ``dead_lettered``, ``replayed``, ``purged``, ...
``status``          how: ``started``, ``succeeded``, ``failed``, ``retrying``, ...
``worker``          ``hostname:pid`` of the process that stored it
``queue``           the queue the message came from
``redelivered``     ``1`` when the broker redelivered the message, else ``0``
``ts``              unix seconds, when the event was built
``attempt``         the attempt number (1 = first run)
``duration_ms``     how long the body ran
``failure_class``   the failure's class (``connection``, ``client_error``, ...)
``exception_type``  the exception's class name (never its message: privacy)
details             phase-specific fields, e.g. the payload as the privacy
                    setting allows (``args_size`` ...), ``countdown``,
                    ``requested``, ``cause``, ``signal``, ``lease_until``; an
                    operator's ``actor``, ``reason``, ``forced``, ``via`` and
                    ``dead_letter_reason``
==================  ==========================================================

A run's events are kept in a Redis list, compactly (``store/chain.py``): the
writer's keyed ``mac`` (with ``tooleffect_audit_key``) is sent with the
fields, and the store numbers the event (``seq``) and chains it. An event
reads as the mapping of its fields (``event["status"]``, ``dict(event)``,
``event.get("task_id")``).

Readers (``AuditLog.events``, ``AuditLog.tail``) get events back through
:meth:`AuditEvent.from_stream`: typed attributes (``ts`` a float, ``attempt``
an int, ``duration_ms`` a float, ``redelivered`` a bool, the chain's ``seq``,
``prev``, ``hash`` and ``mac``, and ``entry_id``), while the mapping stays
exactly the text read, ``{"id": <id>, **fields}`` in stored order: what
``audit show --json`` prints. A run's event reads as ``{"id": <seq>, "seq":
<seq>, **its fields, "prev": <link before>, "hash": <link after>}``, the
links computed from what is stored; a copy in the global stream as ``{"id":
<stream entry id>, **the fields copied}``.
"""

from __future__ import annotations

import math
import time
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import Any

#: The fields every event may carry, in stored order (details follow).
EVENT_FIELDS = (
    "run_id",
    "task_id",
    "tool",
    "effect",
    "phase",
    "status",
    "worker",
    "queue",
    "redelivered",
    "ts",
    "attempt",
    "duration_ms",
    "failure_class",
    "exception_type",
)
#: The chain's fields of an event read back from its run: its number, the
#: links before and after it, and its writer's keyed MAC.
CHAIN_FIELDS = ("seq", "prev", "hash", "mac")


@dataclass(frozen=True)
class AuditEvent(Mapping[str, str]):
    """One audit event (see the module's field list)."""

    run_id: str
    task_id: str
    tool: str
    effect: str
    phase: str
    status: str
    worker: str
    queue: str
    redelivered: bool = False
    ts: float = field(default_factory=time.time)
    attempt: int | None = None
    duration_ms: float | None = None
    failure_class: str | None = None
    exception_type: str | None = None
    #: Phase-specific fields, stored after the common ones.
    details: Mapping[str, str] = field(default_factory=dict)
    #: The run's hash chain, as the store appended it (None on an event not
    #: read back from its run: one being built, or a global-stream copy):
    #: the event's number in its run (1 = first), the hash of the event before
    #: it ('' for the first) and its own hash.
    seq: int | None = field(default=None, kw_only=True)
    prev: str | None = field(default=None, kw_only=True)
    hash: str | None = field(default=None, kw_only=True)
    #: Its writer's MAC under ``tooleffect_audit_key`` (None: not keyed).
    mac: str | None = field(default=None, kw_only=True)
    #: Its id once read back: its ``seq`` as text in its run, or the global
    #: stream's entry id (``<ms>-<n>``) for a copy there; else None.
    entry_id: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in self.details:
            if name in EVENT_FIELDS or name in CHAIN_FIELDS:
                raise ValueError(f"audit detail {name!r} would replace the event's own field")
        object.__setattr__(self, "_fields", self._stream_fields())

    @classmethod
    def from_stream(cls, entry_id: str, fields: Mapping[str, str]) -> AuditEvent:
        """The event read back as ``entry_id`` (its seq in its run, or a global
        stream's entry id) with ``fields`` (decoded to text, in stored order).

        The typed attributes are parsed from the text: ``ts`` and
        ``duration_ms`` floats, ``attempt`` and ``seq`` ints, ``redelivered``
        true for ``1``; fields outside :data:`EVENT_FIELDS` and
        :data:`CHAIN_FIELDS` are its ``details``. A field that is missing or does
        not parse (an event stored by hand, or edited: ``AuditLog.verify`` says
        which) reads as its empty value: ``''``, None, ``ts`` 0.0, never an error.

        The event's mapping is ``{"id": entry_id, **fields}`` exactly, the stored
        text unchanged (``"ts": "1796345286.29"`` stays so), whatever the
        attributes parsed from it.
        """
        get = fields.get
        event = cls(
            run_id=get("run_id", ""),
            task_id=get("task_id", ""),
            tool=get("tool", ""),
            effect=get("effect", ""),
            phase=get("phase", ""),
            status=get("status", ""),
            worker=get("worker", ""),
            queue=get("queue", ""),
            redelivered=get("redelivered", "0").strip().lower() in ("1", "true"),
            ts=_parsed_float(get("ts")) or 0.0,
            attempt=_parsed_int(get("attempt")),
            duration_ms=_parsed_float(get("duration_ms")),
            failure_class=get("failure_class"),
            exception_type=get("exception_type"),
            details={name: value for name, value in fields.items()
                     if name not in _OWN_FIELDS},
            seq=_parsed_int(get("seq")),
            prev=get("prev"),
            hash=get("hash"),
            mac=get("mac"),
            entry_id=entry_id,
        )
        # The mapping is what the stream holds, not the fields rebuilt from
        # the parsed values: callers and --json read the stored text.
        object.__setattr__(event, "_fields", {"id": entry_id, **fields})
        return event

    @classmethod
    def of(
        cls,
        *,
        run_id: str,
        task_id: str,
        tool: str,
        effect: Any,
        phase: str,
        status: str,
        worker: str,
        queue: str,
        redelivered: bool = False,
        attempt: int | None = None,
        duration_ms: float | None = None,
        failure_class: Any = None,
        exception: BaseException | None = None,
        exception_type: str | None = None,
        **details: Any,
    ) -> AuditEvent:
        """An event, from values as the code has them (enums, an exception, numbers);
        ``exception_type`` is the class name of ``exception`` unless given (an
        error known only by name); a detail whose value is None is left out."""
        if exception is not None:
            exception_type = type(exception).__qualname__
        return cls(
            run_id=run_id,
            task_id=task_id,
            tool=tool,
            effect=str(getattr(effect, "value", effect)),
            phase=phase,
            status=str(getattr(status, "value", status)),
            worker=worker,
            queue=queue,
            redelivered=redelivered,
            attempt=attempt,
            duration_ms=duration_ms,
            failure_class=None if failure_class is None else _text(failure_class),
            exception_type=exception_type,
            details={name: _text(value) for name, value in details.items() if value is not None},
        )

    def amended(self, *, phase: str | None = None, status: str | None = None,
                effect: str | None = None, **details: Any) -> AuditEvent:
        """This event with another phase, status or effect and more details (a
        new event)."""
        changes: dict[str, Any] = {"details": {
            **self.details,
            **{name: _text(value) for name, value in details.items() if value is not None}}}
        if phase is not None:
            changes["phase"] = phase
        if status is not None:
            changes["status"] = status
        if effect is not None:
            changes["effect"] = effect
        # What dataclasses.replace does (a new event, __post_init__ run again),
        # without its getattr of every field: this is on every write's path.
        event = object.__new__(AuditEvent)
        event.__dict__.update(self.__dict__, **changes)
        event.__post_init__()
        return event

    def _stream_fields(self) -> dict[str, str]:
        fields = {
            "run_id": self.run_id,
            "task_id": self.task_id,
            "tool": self.tool,
            "effect": self.effect,
            "phase": self.phase,
            "status": self.status,
            "worker": self.worker,
            "queue": self.queue,
            "redelivered": "1" if self.redelivered else "0",
            "ts": f"{self.ts:.6f}",
        }
        if self.attempt is not None:
            fields["attempt"] = str(self.attempt)
        if self.duration_ms is not None:
            fields["duration_ms"] = f"{self.duration_ms:.3f}"
        if self.failure_class is not None:
            fields["failure_class"] = self.failure_class
        if self.exception_type is not None:
            fields["exception_type"] = self.exception_type
        fields.update(self.details)
        if self.seq is not None or self.entry_id is not None:
            # A read-back event rebuilt (dataclasses.replace): laid out as stored.
            chain: dict[str, str] = {} if self.entry_id is None else {"id": self.entry_id}
            if self.seq is not None:
                chain["seq"] = str(self.seq)
            fields = {**chain, **fields}
            if self.prev is not None:
                fields["prev"] = self.prev
            if self.mac is not None:
                fields["mac"] = self.mac
            if self.hash is not None:
                fields["hash"] = self.hash
        return fields

    # -- the mapping of its stream fields --------------------------------------

    def __getitem__(self, name: str) -> str:
        return self._fields_map[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields_map)

    def __len__(self) -> int:
        return len(self._fields_map)

    # Mapping's mixins go through __getitem__ field by field; an event's
    # fields are a dict already, and flattening them is on every call's path.
    def __contains__(self, name: object) -> bool:
        return name in self._fields_map

    def keys(self) -> KeysView[str]:
        return self._fields_map.keys()

    def items(self) -> ItemsView[str, str]:
        return self._fields_map.items()

    def values(self) -> ValuesView[str]:
        return self._fields_map.values()

    def get(self, name: str, default: Any = None) -> Any:
        return self._fields_map.get(name, default)

    @property
    def _fields_map(self) -> dict[str, str]:
        fields: dict[str, str] = self.__dict__["_fields"]
        return fields


#: The fields that are attributes of their own, not details.
_OWN_FIELDS = frozenset(EVENT_FIELDS) | frozenset(CHAIN_FIELDS)


def _parsed_float(value: str | None) -> float | None:
    """``value`` as a float; None when it is missing or not a finite number."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _parsed_int(value: str | None) -> int | None:
    """``value`` as an int (``"3"``, also ``"3.0"`` as Lua may write it); None when
    it is missing or not a whole number."""
    number = _parsed_float(value)
    if number is None or not number.is_integer():
        return None
    return int(number)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(getattr(value, "value", value))
