"""The dead-letter protocol of a tool call, and the one builder of its letter.

The pool process (``ToolTask``) decides a dead letter and the worker's main
process (``ToolRequest``), which holds the message, stores it (the letter
travels as a :class:`~celery_tooleffect.worker.handoff.PendingLetter`); the
main process also dead-letters on its own (a pool child that died). The order
of that protocol lives here, once:

1. journal to ``dead_lettering`` with the outcome event (skipped when the store
   is down; refused when another attempt owns the entry: then this worker
   lost its lease and must not dead-letter); where the tool runs;
2. store the dead letter with the message as delivered (``HSETNX``: the first
   reason wins); if that fails the caller keeps the message; where the
   message is;
3. journal to ``dead_lettered`` (best effort: a later delivery that finds
   ``dead_lettering`` finishes it);
4. the caller rejects the message without requeue.
"""

from __future__ import annotations

import logging

from celery.utils.serialization import get_pickleable_exception

from ..errors import DeadLettered, LeaseLost, StoreUnavailable
from ..events import AuditEvent
from ..failures import FailureClass
from ..states import DeadLetterReason, JournalState
from ..store import states
from ..store.dead_letter_record import DeadLetter
from ..store.envelope import MessageEnvelope
from ..store.runtime import ToolRuntime
from .attempt import Attempt
from .handoff import PendingLetter

logger = logging.getLogger(__name__)


def begin_dead_letter(
    runtime: ToolRuntime,
    attempt: Attempt,
    letter: DeadLetter,
    *,
    outcome_event: AuditEvent,
    owned: bool,
    journalled: bool,
    allowed: frozenset[JournalState] | None = None,
) -> None:
    """Step 1: the journal to ``dead_lettering`` with the outcome event.

    Whoever holds the message finishes with :func:`finish_dead_letter`: in a
    pool process the tool decides, and the worker's main process, which holds
    the message, stores the letter (:func:`dead_lettered` carries it there).

    ``owned``: the caller holds the attempt's owner token, so step 1 is
    fenced by it. Raises :class:`LeaseLost` when another attempt owns the
    entry. ``journalled`` is false for read-only tools and for messages
    refused before any attempt began. When the journal does not answer, the
    letter of an owned attempt says its outcome could not be recorded
    (``letter`` is changed in place).
    """
    ref = attempt.ref
    if allowed is None:
        # Without the owner token a running attempt is someone else's.
        allowed = states.DEAD_LETTER_FROM if owned else states.DEAD_LETTER_UNOWNED_FROM
    if not journalled:
        runtime.audit.record_step(outcome_event)
        return
    try:
        moved = runtime.journal.transition(
            ref,
            new_state=JournalState.DEAD_LETTERING,
            allowed=allowed,
            token=attempt.token if owned else "",
            event=outcome_event,
            fields={
                "reason": letter.reason,
                "failure_class": letter.failure_class,
                "exception_type": letter.exception_type,
                "body_completed": "1" if letter.body_completed else "0",
            },
        )
    except StoreUnavailable as store_down:
        logger.warning("journal down while dead-lettering %s: %s", ref.task_id, store_down)
        if owned:  # our running attempt ends unrecorded
            _fail_closed(letter, store_down)
    else:
        if not moved:
            raise LeaseLost(f"{ref.task_id}: another attempt owns the journal entry")


def dead_lettered(
    letter: DeadLetter,
    exc: BaseException | None,
    *,
    pending_letter: PendingLetter | None = None,
    error: BaseException | None = None,
) -> DeadLettered:
    """The rejection that ends a delivery as ``letter``; ``pending_letter``: the
    letter on its way to the process that holds the message (see
    :mod:`celery_tooleffect.worker.handoff`); ``error``: what Celery's result
    shows (:attr:`DeadLettered.error`), when it is not the rejection.

    Its ``reason`` is made picklable first (Celery's
    ``get_pickleable_exception``, as its tracer does for a failure): the
    rejection crosses the pool's pipe, and an exception that cannot be
    unpickled there would stop the worker's main process.
    """
    return DeadLettered(
        f"{letter.exception_type or 'error'} in {letter.name}[{letter.task_id}]",
        letter.failure_class,
        letter.reason,
        reason=None if exc is None else get_pickleable_exception(exc),
        pending_letter=pending_letter,
        error=error,
    )


def finish_dead_letter(
    runtime: ToolRuntime, attempt: Attempt, letter: DeadLetter, *, journalled: bool
) -> None:
    """Steps 2 and 3: store ``letter`` (with its message), then the journal to
    ``dead_lettered`` (best effort: a later delivery that finds
    ``dead_lettering`` finishes it).

    Raises :class:`StoreUnavailable` when the letter could not be stored:
    the message must then be kept.
    """
    runtime.dead_letters.store(letter)
    dead_lettered_event = attempt.context.event(
        "dead_lettered",
        letter.reason,
        attempt=letter.attempts or None,
        failure_class=letter.failure_class,
        exception_type=letter.exception_type,
    )
    if journalled:
        try:
            runtime.journal.transition(
                attempt.ref,
                new_state=JournalState.DEAD_LETTERED,
                allowed=states.FINISH_DEAD_LETTER_FROM,
                event=dead_lettered_event,
            )
        except StoreUnavailable as store_down:
            logger.warning("journal down after dead-lettering %s: %s",
                           attempt.task_id, store_down)
    else:
        runtime.audit.record_step(dead_lettered_event)


def _fail_closed(letter: DeadLetter, store_down: StoreUnavailable) -> None:
    """The letter of a write whose outcome could not be recorded says so.

    Whatever the body raised, the audit log misses how it ended: the dead
    letter is the only record, and it carries the class of an unrecorded
    write (UNKNOWN, AuditPersistenceFailed).
    """
    if letter.exception_type != "AuditPersistenceFailed":
        letter.error = (
            f"{letter.exception_type}: {letter.error}; its outcome could not be recorded: "
            f"{store_down}"
        )
        letter.exception_type = "AuditPersistenceFailed"
        letter.failure_class = FailureClass.UNKNOWN.value


def build_letter(
    attempt: Attempt,
    *,
    reason: DeadLetterReason,
    failure_class: FailureClass,
    exc: BaseException | None,
    attempts: int,
    body_completed: bool = False,
    message: MessageEnvelope | None = None,
    error: str | None = None,
) -> DeadLetter:
    """The dead letter of ``attempt``: why it is one, and (when the caller holds
    it) the message as the broker delivered it; ``error`` replaces the text of
    ``exc``. The one builder of a letter, wherever it is decided."""
    return DeadLetter(
        task_id=attempt.task_id,
        name=attempt.name,
        queue=attempt.queue,
        reason=reason.value,
        failure_class=failure_class.value,
        effect=attempt.effect.value,
        run_id=attempt.run_id,
        exception_type=type(exc).__qualname__ if exc is not None else "",
        error=error if error is not None else str(exc) if exc is not None else "",
        attempts=attempts,
        worker=attempt.context.worker,
        body_completed=body_completed,
        message=message,
    )


