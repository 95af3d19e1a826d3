"""Audit events: the typed, frozen record of one step of a tool call.

Every event the package stores (by a worker, in the same atomic step as a
journal transition, or by an operator's action) is an :class:`AuditEvent`,
built by :meth:`AuditEvent.of` or, for an attempt, by ``StepContext.event``.
In a run's Redis stream it is a flat hash of text fields, in this order, the
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

The store adds ``seq``, ``prev`` and ``hash`` (the run's hash chain) when it
appends the event. An event reads as the mapping of its stream fields
(``event["status"]``, ``dict(event)``); readers of a stream get those
mappings back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
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
#: Fields the store adds when it appends an event.
CHAIN_FIELDS = ("seq", "prev", "hash")


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

    def __post_init__(self) -> None:
        for name in self.details:
            if name in EVENT_FIELDS or name in CHAIN_FIELDS:
                raise ValueError(f"audit detail {name!r} would replace the event's own field")
        object.__setattr__(self, "_fields", self._stream_fields())

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
                **details: Any) -> AuditEvent:
        """This event with another phase or status and more details (a new event)."""
        return replace(
            self,
            phase=self.phase if phase is None else phase,
            status=self.status if status is None else status,
            details={**self.details,
                     **{name: _text(value) for name, value in details.items()
                        if value is not None}},
        )

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
        return fields

    # -- the mapping of its stream fields --------------------------------------

    def __getitem__(self, name: str) -> str:
        return self._fields_map[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields_map)

    def __len__(self) -> int:
        return len(self._fields_map)

    @property
    def _fields_map(self) -> dict[str, str]:
        fields: dict[str, str] = self.__dict__["_fields"]
        return fields


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(getattr(value, "value", value))
