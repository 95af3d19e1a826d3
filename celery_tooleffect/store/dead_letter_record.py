"""A dead letter: what is kept of a task that will not run again by itself.

:class:`DeadLetter` is the record, and its JSON form is the envelope the
dead-letter store keeps (:mod:`celery_tooleffect.store.dead_letters`): the
message exactly as the broker delivered it (see
:mod:`celery_tooleffect.store.envelope`), plus why, when and by whom it was
dead-lettered. Reading one back gives an equal record, of this release's
envelope version or of the one before it. Nothing here talks to Redis.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .envelope import MessageEnvelope

#: Version of the envelope this release writes and reads (see :class:`DeadLetter`).
ENVELOPE_VERSION = 2


#: Content types whose decoding runs no code of the message's choosing
#: (kombu's YAML decoder is ``yaml.safe_load``).
SAFE_CONTENT = ("json", "msgpack", "yaml")


def conflict_letter_id(task_id: str, digest: str) -> str:
    """The id a call-id conflict is dead-lettered under: not the task id, whose
    dead letter (if any) and journal are the first call's."""
    return f"{task_id}.conflict-{digest[:12]}"


@dataclass
class DeadLetter:
    """A dead-lettered task: the message as the broker delivered it, and why it is here.

    ``message`` keeps the message whole, so that a replay publishes the same
    bytes, headers and properties (see :mod:`celery_tooleffect.store.envelope`);
    whoever can read the dead-letter keys can read it. Every letter this
    release stores has one (envelope version 2). A letter of version 1, which
    only development builds wrote (no release did), kept no message: it is read
    without one (its arguments are not shown), its replay is refused, and it
    can be purged.
    """

    task_id: str
    name: str
    queue: str
    reason: str
    failure_class: str
    effect: str
    run_id: str = ""
    exception_type: str = ""
    error: str = ""
    attempts: int = 0
    worker: str = ""
    body_completed: bool = False
    dead_lettered_at: float = field(default_factory=time.time)
    #: The message as the broker delivered it (None only on its way from the
    #: pool process, which does not hold it, and in a letter of version 1).
    message: MessageEnvelope | None = None
    #: Envelope version (a stored letter without one is of version 1).
    version: int = ENVELOPE_VERSION
    #: Outcomes reported by a worker that had lost its lease after the task
    #: was dead-lettered: the write still ran, and this says how it ended.
    late_outcomes: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the stored envelope); :meth:`from_dict` reads it back equal."""
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["message"] = self.message.to_dict() if self.message is not None else None
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeadLetter:
        known = set(cls.__dataclass_fields__)
        values = {key: value for key, value in data.items() if key in known}
        values.setdefault("version", 1)  # version 1 did not say its version
        message = values.get("message")
        values["message"] = MessageEnvelope.from_dict(message) if message else None
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes) -> DeadLetter:
        return cls.from_dict(json.loads(text))

    @property
    def args(self) -> list[Any]:
        """The task's positional arguments, decoded (JSON, msgpack or YAML bodies;
        empty when the body cannot be decoded that way). Use :meth:`payload`
        with the app's ``accept_content`` for other content types."""
        return self._safe_payload()[0]

    @property
    def kwargs(self) -> dict[str, Any]:
        """The task's keyword arguments, decoded as :attr:`args` is."""
        return self._safe_payload()[1]

    def _safe_payload(self) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
        try:
            return self.payload(SAFE_CONTENT)
        except Exception:
            return [], {}, {}

    @property
    def headers_as_delivered(self) -> Mapping[str, Any]:
        """The message's headers (none without a message)."""
        return self.message.headers if self.message is not None else {}

    def payload(self, accept: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
        """``(args, kwargs, embed)`` of the task, decoded for display only.

        ``accept``: the app's ``accept_content``. Raises what kombu raises when
        the body cannot (or may not) be decoded. ``embed`` holds the canvas
        fields of a protocol 2 body (``callbacks``, ``errbacks``, ``chain``,
        ``chord``).
        """
        if self.message is None:
            raise ValueError(f"{self.task_id}: no message kept (envelope version {self.version})")
        return self.message.task_payload(accept)

