"""The dead-letter protocol of a tool call, and the one builder of its letter.

The pool process (``ToolTask``) decides a dead letter and the worker's main
process (``ToolRequest``), which holds the message, stores it; the main process
also dead-letters on its own (a pool child that died). The order of that
protocol lives here, once:

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
from dataclasses import dataclass, replace
from typing import Any

from celery.utils.serialization import get_pickleable_exception

from ..errors import DeadLettered, LeaseLost, StoreUnavailable
from ..events import AuditEvent
from ..failures import FailureClass
from ..store import states
from ..store.dead_letters import DeadLetter, DeadLetterReason
from ..store.envelope import MessageEnvelope
from ..store.runtime import ToolRuntime
from ..store.states import JournalState
from .attempt import Attempt

logger = logging.getLogger(__name__)


def begin_dead_letter(
    runtime: ToolRuntime,
    attempt: Attempt,
    letter: DeadLetter,
    *,
    outcome_event: AuditEvent,
    owned: bool,
    exc: BaseException | None,
    journalled: bool,
    allowed: frozenset[JournalState] | None = None,
    error: BaseException | None = None,
) -> DeadLettered:
    """Step 1: the journal to ``dead_lettering`` with the outcome event.

    Returns the rejection that carries ``letter`` (without its message)
    to whoever holds the message, which finishes with
    :func:`finish_dead_letter`: in a pool process the tool decides, and
    the worker's main process, which holds the message, stores it.

    ``owned``: the caller holds the attempt's owner token, so step 1 is
    fenced by it. Raises :class:`LeaseLost` when another attempt owns the
    entry. ``journalled`` is false for read-only tools and for messages
    refused before any attempt began. ``error``: what Celery's result shows
    (:attr:`DeadLettered.error`), when it is not the rejection.

    The rejection's ``reason`` is made picklable first (Celery's
    ``get_pickleable_exception``, as its tracer does for a failure): the
    rejection crosses the pool's pipe, and an exception that cannot be
    unpickled there would stop the worker's main process.
    """
    ref = attempt.ref
    if allowed is None:
        # Without the owner token a running attempt is someone else's.
        allowed = states.DEAD_LETTER_FROM if owned else states.DEAD_LETTER_UNOWNED_FROM
    if journalled:
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
    else:
        runtime.audit.record_step(outcome_event)
    rejection = DeadLettered(
        f"{letter.exception_type or 'error'} in {letter.name}[{letter.task_id}]",
        letter.failure_class,
        letter.reason,
        reason=None if exc is None else get_pickleable_exception(exc),
    )
    rejection.pending_letter = PendingLetter(replace(letter, message=None), journalled)
    rejection.error = error
    return rejection


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


#: Where a letter decided with the tool's own error as Celery's result waits
#: in the pool process: on the request (:func:`decided_with_error`), then on
#: the ``ExceptionInfo`` Celery's tracer sends to the worker's main process
#: (``worker/signals.py`` moves it there), which pops it (``ToolRequest``).
PENDING_LETTER_FIELD = "tooleffect_pending_letter"


def decided_with_error(request: Any, rejection: DeadLettered) -> BaseException | None:
    """The error to raise in place of ``rejection`` in the pool process, with
    its letter left on ``request`` for the worker's main process; None when
    ``rejection`` itself is the result (a failure of the package's own)."""
    if rejection.error is None or rejection.keep_result or rejection.pending_letter is None:
        return None
    setattr(request, PENDING_LETTER_FIELD, rejection.pending_letter)
    rejection.pending_letter = None
    return rejection.error


@dataclass(frozen=True)
class PendingLetter:
    """A dead letter decided by a tool, on its way to the process that holds the message.

    Travels inside :class:`~celery_tooleffect.errors.DeadLettered` from the pool
    process to the worker's main process (pickled with it), which adds the
    message and stores it (:func:`finish_dead_letter`).
    """

    letter: DeadLetter
    journalled: bool


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


