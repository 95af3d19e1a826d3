"""Dead letters made by a test without a worker: what a worker would store for a
call, its message as the broker delivers it (envelope version 2)."""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu.serialization import dumps

from celery_tooleffect.identity import RUN_ID_HEADER
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.envelope import MessageEnvelope


def message_of_call(app: Celery, task_id: str, name: str, args: Any = (), kwargs: Any = None,
                    *, run_id: str, queue: str = "tools") -> MessageEnvelope:
    """The protocol 2 message ``apply_async`` would publish for the call (JSON
    body), as a worker of ``queue`` receives it."""
    message = app.amqp.as_task_v2(task_id, name, args=list(args), kwargs=dict(kwargs or {}))
    content_type, content_encoding, body = dumps(  # type: ignore[no-untyped-call]
        message.body, serializer="json")
    return MessageEnvelope(
        body=body.encode("utf-8") if isinstance(body, str) else body,
        content_type=content_type, content_encoding=content_encoding,
        headers={**message.headers, RUN_ID_HEADER: run_id},
        properties={**message.properties, "delivery_mode": 2, "priority": 0},
        exchange="", routing_key=queue,
    )


def letter_of_call(app: Celery, *, task_id: str, name: str, args: Any = (),
                   kwargs: Any = None, run_id: str, queue: str = "tools",
                   **fields: Any) -> DeadLetter:
    """The dead letter of a call of ``name`` with ``args`` and ``kwargs``
    (``fields``: reason, failure class, effect ... as :class:`DeadLetter` takes them)."""
    return DeadLetter(task_id=task_id, name=name, queue=queue, run_id=run_id,
                      message=message_of_call(app, task_id, name, args, kwargs,
                                              run_id=run_id, queue=queue),
                      **fields)
