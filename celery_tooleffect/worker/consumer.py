"""Dead-letter the task messages Celery's consumer refuses before any task code runs.

Celery's worker consumer throws some messages away without running anything:

- an unknown task name (``Consumer.on_unknown_task``) or a message with no task
  name at all (``on_unknown_message``): rejected without requeue;
- a body that cannot be decoded (``on_decode_error``: a bad serializer payload,
  a failed decompression) or whose content type is not in ``accept_content``
  (``ContentDisallowed``, which Celery routes to ``on_invalid_task``): acked or
  rejected;
- an invalid message (``on_invalid_task``, ``InvalidTaskError``: kwargs that
  are not a mapping, an unparsable ``eta`` or ``expires``): rejected.

On Redis every one of these deletes the message. :class:`DeadLetterStep`, a
consumer bootstep that :func:`install_consumer_step` adds to an app when a
``ToolTask`` is bound to it, stores each of them as a dead letter first:

=====================================  ======================================
Celery handler                         dead-letter reason
=====================================  ======================================
``on_unknown_task``,                   ``UNKNOWN_TASK`` (effect resolved by
``on_unknown_message``                 name: an unknown name is
                                       NON_IDEMPOTENT_WRITE)
``on_decode_error``, and               ``UNDECODABLE_MESSAGE``
``on_invalid_task`` for
``ContentDisallowed``/``DecodeError``
``on_invalid_task`` (anything else)    ``MALFORMED_MESSAGE``
=====================================  ======================================

The failure class is always ``client_error``: the producer sent something no
worker can run. The letter is keyed by the message's task id (a generated one
when the message has none, so a message without an id that is delivered twice
yields two letters) and keeps the message exactly as it was delivered (body
bytes, content type and encoding, headers, properties, routing: see
:mod:`celery_tooleffect.store.envelope`), so that once the task exists (or its
content type is accepted) a replay publishes it unchanged.

What it promises:

- The dead letter is stored (``HSETNX``: the first reason wins) *before*
  Celery's own handler acknowledges or rejects the message; an audit event
  with phase ``dead_lettered`` follows (fail-soft).
- When it cannot be stored (:class:`~celery_tooleffect.errors.StoreUnavailable`,
  or any unexpected error while building it) Celery's handler is not called:
  the message stays unacknowledged and is requeued with
  ``message.reject(requeue=True)`` after :data:`REQUEUE_DELAY` seconds (on
  the worker's event loop; immediately when the worker has none). The delay
  keeps a store outage from turning into a hot redelivery loop. If even the
  requeue fails, the message stays in the broker's unacked set and kombu
  restores it after the visibility timeout. It is never deleted.
- The store call is a single blocking Redis round trip on the consumer's
  thread, bounded by ``tooleffect_socket_timeout``; it only happens for bad
  messages.

Why a bootstep that wraps the consumer's methods: the handlers are plain
methods of ``celery.worker.consumer.Consumer``, and Celery offers neither a
signal that fires *before* the reject (``task_rejected`` and ``task_unknown``
fire after it, when the message is gone) nor a setting for them. Replacing
``worker_consumer`` with a subclass would fight any other extension that does
the same. A consumer bootstep is instantiated in ``Consumer.__init__``, before
any step starts, so the wrappers are in place both for ``create_task_handler``
(which captures ``on_unknown_message``, ``on_unknown_task`` and
``on_invalid_task`` when the consume loop starts) and for the ``Tasks`` step,
which hands ``on_decode_error`` to kombu's ``Consumer`` when it starts.

What reaches it only with the package's atomic fetch: an item in a queue that
is no kombu envelope (not JSON, not UTF-8, no ``properties`` or delivery tag,
a body that is not valid base64). kombu's own fetch pops it with ``BRPOP`` and
fails while it builds the ``Message``, before the item is in ``unacked``: the
item is lost, and the error leaves the event loop (a ``ValueError`` stops the
worker, "Unrecoverable error"; a ``KeyError`` makes the consumer reconnect).
The atomic fetch (:mod:`celery_tooleffect.worker.transport`) records such an
item unacknowledged as a kombu envelope of content type ``UNREADABLE`` whose
body is the item's bytes, and delivers it: Celery's consumer cannot decode
it and calls ``on_decode_error``, where it becomes a dead letter
``undecodable_message`` whose body is exactly what the queue held.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from celery import bootsteps
from celery.exceptions import NotRegistered
from kombu.exceptions import ContentDisallowed, DecodeError

from ..effect import ToolEffect, ToolEffectResolver
from ..errors import StoreUnavailable
from ..failures import FailureClass
from ..states import DeadLetterReason
from ..store.audit import StepContext
from ..store.dead_letter_record import DeadLetter
from ..store.envelope import MessageEnvelope
from ..store.runtime import runtime_for
from .attempt import Attempt
from .letters import build_letter
from .transport_unreadable import UNREADABLE

logger = logging.getLogger(__name__)

#: Seconds a message whose dead letter could not be stored stays unacknowledged
#: before it is requeued (and so delivered, and tried, again).
REQUEUE_DELAY = 1.0

#: Set on a consumer whose handlers are wrapped, so they are wrapped once.
_WRAPPED = "_tooleffect_dead_letters"

def install_consumer_step(app: Any) -> None:
    """Make workers of ``app`` dead-letter the messages their consumer refuses.

    Idempotent and cheap: ``app.steps["consumer"]`` is a set, and adding the
    same class twice leaves one step. Takes effect for consumers created
    afterwards (a worker creates its consumer after the app is finalized, when
    every ``ToolTask`` is bound).
    """
    app.steps["consumer"].add(DeadLetterStep)


class DeadLetterStep(bootsteps.Step):  # type: ignore[misc]
    """Consumer bootstep: wraps the consumer's refusal handlers (see module docs)."""

    name = "celery_tooleffect.consumer.DeadLetterStep"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        if not parent.__dict__.get(_WRAPPED):
            RefusedMessages(parent).install()
            parent.__dict__[_WRAPPED] = True


class RefusedMessages:
    """Wraps one consumer's refusal handlers so that each stores a dead letter first."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.app = consumer.app

    def install(self) -> None:
        consumer = self.consumer
        unknown_message: Callable[..., Any] = consumer.on_unknown_message
        unknown_task: Callable[..., Any] = consumer.on_unknown_task
        invalid_task: Callable[..., Any] = consumer.on_invalid_task
        decode_error: Callable[..., Any] = consumer.on_decode_error

        def on_unknown_message(body: Any, message: Any) -> None:
            if self.dead_letter(message, body, DeadLetterReason.UNKNOWN_TASK, None):
                _drop(unknown_message, message, body, message)

        def on_unknown_task(body: Any, message: Any, exc: BaseException) -> None:
            if self.dead_letter(message, body, DeadLetterReason.UNKNOWN_TASK, exc):
                _drop(unknown_task, message, body, message, exc)

        def on_invalid_task(body: Any, message: Any, exc: BaseException) -> None:
            reason = (
                DeadLetterReason.UNDECODABLE_MESSAGE
                if isinstance(exc, (ContentDisallowed, DecodeError))
                else DeadLetterReason.MALFORMED_MESSAGE
            )
            if self.dead_letter(message, body, reason, exc):
                _drop(invalid_task, message, body, message, exc)

        def on_decode_error(message: Any, exc: BaseException) -> None:
            if getattr(message, "content_type", None) == UNREADABLE:
                # Wrapped by the atomic fetch: say what it was, not that its
                # content type is refused.
                exc = DecodeError(
                    f"the queue {(message.delivery_info or {}).get('routing_key')!r} held an item "
                    "that is no kombu envelope (not JSON, or no properties or delivery tag, "
                    "or a body kombu cannot decode); the letter's body is that item, "
                    "byte for byte")
            if self.dead_letter(message, None, DeadLetterReason.UNDECODABLE_MESSAGE, exc):
                _drop(decode_error, message, message, exc)

        consumer.on_unknown_message = on_unknown_message
        consumer.on_unknown_task = on_unknown_task
        consumer.on_invalid_task = on_invalid_task
        consumer.on_decode_error = on_decode_error

    def dead_letter(
        self, message: Any, body: Any, reason: DeadLetterReason, exc: BaseException | None
    ) -> bool:
        """Store ``message`` as a dead letter; True when Celery may now drop it.

        True when the letter was stored now or the task already was one (an
        earlier delivery stored it and the worker stopped before dropping the
        message). False when it could not be stored: the message is then kept
        (see :meth:`keep`) and must not be acknowledged or rejected.
        """
        if not callable(getattr(message, "reject", None)):
            # Not a kombu Message (kombu failed to build one): nothing to keep.
            return True
        try:
            letter, context = build_refused_letter(self.app, message, body, reason, exc)
        except Exception:
            logger.critical("refused message (%s) could not be described, keeping it and "
                            "requeueing it in %.1fs", reason.value, REQUEUE_DELAY, exc_info=True)
            self.keep(message)
            return False
        try:
            runtime = runtime_for(self.app)
            created = runtime.dead_letters.store(letter)
        except Exception as failed:
            expected = isinstance(failed, StoreUnavailable)
            logger.log(
                logging.ERROR if expected else logging.CRITICAL,
                "refused message %s[%s] (%s) not dead-lettered, keeping it and requeueing it "
                "in %.1fs: %s: %s", letter.name or "<no task name>", letter.task_id,
                reason.value, REQUEUE_DELAY, type(failed).__name__, failed,
                exc_info=not expected,
            )
            self.keep(message)
            return False
        if created:
            logger.warning(
                "refused message %s[%s] dead-lettered (%s): %s",
                letter.name or "<no task name>", letter.task_id, reason.value,
                letter.error or letter.exception_type,
            )
            runtime.audit.record_step(
                context.event(
                    "dead_lettered", reason.value,
                    failure_class=letter.failure_class, exception_type=letter.exception_type,
                )
            )
        return True

    def keep(self, message: Any) -> None:
        """Requeue ``message`` after :data:`REQUEUE_DELAY`, leaving it unacked until then."""
        hub = getattr(self.consumer, "hub", None)
        if hub is not None:
            try:
                hub.call_later(REQUEUE_DELAY, _requeue, message)
                return
            except Exception as exc:
                logger.warning("could not schedule the requeue, requeueing now: %s", exc)
        _requeue(message)


def _drop(handler: Callable[..., Any], message: Any, *args: Any) -> None:
    """Let Celery's own handler drop a message whose dead letter is stored.

    Celery's handlers trust the message too: ``on_unknown_task`` marks the
    task failed on the result backend, which raises for an id that is not
    text (None, a number) *after* rejecting the message, and the error would
    stop the worker. The letter is stored, so the message may go: it is
    rejected here if the handler failed before doing so.
    """
    try:
        handler(*args)
    except Exception:
        logger.exception("Celery's handler failed on a refused message that is dead-lettered "
                         "already; dropping the message")
        try:
            if not message.acknowledged:
                message.reject(requeue=False)
        except Exception as exc:
            logger.error("refused message %s not dropped (%s: %s); the broker restores it "
                         "after the visibility timeout and it is dropped then",
                         getattr(message, "delivery_tag", "?"), type(exc).__name__, exc)


def _requeue(message: Any) -> None:
    try:
        if not message.acknowledged:
            message.reject(requeue=True)
    except Exception as exc:
        logger.error(
            "refused message %s not requeued (%s: %s); it stays unacknowledged and the "
            "broker restores it after the visibility timeout",
            getattr(message, "delivery_tag", "?"), type(exc).__name__, exc,
        )


def build_refused_letter(
    app: Any, message: Any, body: Any, reason: DeadLetterReason, exc: BaseException | None
) -> tuple[DeadLetter, StepContext]:
    """The dead letter of a refused ``message``, and the audit context of its task.

    ``body`` is the payload Celery already decoded (protocol 1), if any. Reads
    only what can be read: a field that cannot be decoded is left empty; the
    letter's message keeps everything as it was delivered.
    """
    headers = _mapping(getattr(message, "headers", None))
    payload = body if body is not None else _decoded(message, reason)
    fields = dict(payload) if isinstance(payload, Mapping) else {}
    fields.update(headers)

    task_id = str(fields.get("id") or uuid.uuid4().hex)
    name = str(fields.get("task") or "")
    attempt = Attempt.of(
        fields,
        task_id=task_id,
        name=name,
        effect=_effect(app, name),
        delivery_info=_mapping(getattr(message, "delivery_info", None)),
        default_queue=app.conf.task_default_queue,
        token="",
    )
    error = None
    if reason is DeadLetterReason.UNKNOWN_TASK:
        # Celery passes the KeyError of its strategy lookup (or nothing).
        exc = NotRegistered(name) if name else None
        error = (
            f"task {name!r} is not registered on this worker" if name
            else "not a Celery task message: it names no task"
        )
    letter = build_letter(
        attempt, reason=reason, failure_class=FailureClass.CLIENT_ERROR, exc=exc,
        attempts=0, message=MessageEnvelope.of_message(message), error=error,
    )
    return letter, attempt.context


def _decoded(message: Any, reason: DeadLetterReason) -> Any:
    """The decoded body, or None when it cannot (or must not) be decoded."""
    if reason is DeadLetterReason.UNDECODABLE_MESSAGE:
        return None
    try:
        return message.decode()
    except Exception:
        return None


def _effect(app: Any, name: str) -> ToolEffect:
    try:
        return ToolEffectResolver(app).effect_for(name)
    except Exception:
        return ToolEffectResolver.UNKNOWN_TOOL_EFFECT


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
