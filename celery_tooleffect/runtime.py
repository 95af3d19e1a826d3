"""The parts one app's tools share, and the dead-letter protocol built on them.

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
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .attempt import Attempt
from .audit import AuditLog
from .dead_letters import DeadLetter, DeadLetterReason, DeadLetters
from .envelope import MessageEnvelope
from .errors import DeadLettered, LeaseLost, StoreUnavailable
from .failures import FailureClass, FailureClassifier
from .journal import Journal, JournalState
from .leases import Leases
from .settings import Settings, settings_for

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

#: Journal states a dead letter may be begun from.
DEAD_LETTER_FROM = (
    "absent",
    JournalState.RUNNING,
    JournalState.RETRY_SCHEDULED,
    JournalState.INTERRUPTED,
    JournalState.REPLAYED,
    JournalState.FAILED,
)


class ToolRuntime:
    """Settings, audit log, journal, dead letters and classifier of one app."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.settings: Settings = settings_for(app)
        self.audit = AuditLog(app, self.settings)
        self.journal = Journal(self.settings, self.audit)
        self.dead_letters = DeadLetters(app, self.settings)
        self.leases = Leases(self.settings)
        self.classifier = FailureClassifier.from_setting(self.settings.failure_classes)

    def dead_letter(
        self,
        attempt: Attempt,
        letter: DeadLetter,
        *,
        outcome_event: Mapping[str, str],
        owned: bool,
        exc: BaseException | None,
        journalled: bool,
        allowed: Iterable[JournalState | str] | None = None,
    ) -> DeadLettered:
        """Dead-letter ``attempt`` in one process (steps 1 to 3); return the
        exception that rejects its message.

        ``letter`` must carry the message. Raises what :meth:`begin_dead_letter`
        and :meth:`finish_dead_letter` raise.
        """
        rejection = self.begin_dead_letter(
            attempt, letter, outcome_event=outcome_event, owned=owned, exc=exc,
            journalled=journalled, allowed=allowed,
        )
        self.finish_dead_letter(attempt, letter, journalled=journalled)
        rejection.pending_letter = None
        return rejection

    def begin_dead_letter(
        self,
        attempt: Attempt,
        letter: DeadLetter,
        *,
        outcome_event: Mapping[str, str],
        owned: bool,
        exc: BaseException | None,
        journalled: bool,
        allowed: Iterable[JournalState | str] | None = None,
    ) -> DeadLettered:
        """Step 1: the journal to ``dead_lettering`` with the outcome event.

        Returns the rejection that carries ``letter`` (without its message)
        to whoever holds the message, which finishes with
        :meth:`finish_dead_letter`: in a pool process the tool decides, and
        the worker's main process, which holds the message, stores it.

        ``owned``: the caller holds the attempt's owner token, so step 1 is
        fenced by it. Raises :class:`LeaseLost` when another attempt owns the
        entry. ``journalled`` is false for read-only tools and for messages
        refused before any attempt began.
        """
        ref = attempt.ref
        if allowed is None:
            # Without the owner token a running attempt is someone else's.
            allowed = DEAD_LETTER_FROM if owned else DEAD_LETTER_FROM[:1] + DEAD_LETTER_FROM[2:]
        if journalled:
            try:
                moved = self.journal.transition(
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
            self.audit.record_step(outcome_event)
        rejection = DeadLettered(
            f"{letter.exception_type or 'error'} in {letter.name}[{letter.task_id}]",
            letter.failure_class,
            letter.reason,
            reason=exc,
        )
        rejection.pending_letter = PendingLetter(replace(letter, message=None), journalled)
        return rejection

    def finish_dead_letter(self, attempt: Attempt, letter: DeadLetter, *, journalled: bool) -> None:
        """Steps 2 and 3: store ``letter`` (with its message), then the journal to
        ``dead_lettered`` (best effort: a later delivery that finds
        ``dead_lettering`` finishes it).

        Raises :class:`StoreUnavailable` when the letter could not be stored:
        the message must then be kept.
        """
        self.dead_letters.store(letter)
        dead_lettered_event = attempt.context.event(
            "dead_lettered",
            letter.reason,
            attempt=letter.attempts or None,
            failure_class=letter.failure_class,
            exception_type=letter.exception_type,
        )
        if journalled:
            try:
                self.journal.transition(
                    attempt.ref,
                    new_state=JournalState.DEAD_LETTERED,
                    allowed=[JournalState.DEAD_LETTERING],
                    event=dead_lettered_event,
                )
            except StoreUnavailable as store_down:
                logger.warning("journal down after dead-lettering %s: %s",
                               attempt.task_id, store_down)
        else:
            self.audit.record_step(dead_lettered_event)


@dataclass(frozen=True)
class PendingLetter:
    """A dead letter decided by a tool, on its way to the process that holds the message.

    Travels inside :class:`~celery_tooleffect.errors.DeadLettered` from the pool
    process to the worker's main process (pickled with it), which adds the
    message and stores it (:meth:`ToolRuntime.finish_dead_letter`).
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
) -> DeadLetter:
    """The dead letter of ``attempt``: why it is one, and (when the caller holds
    it) the message as the broker delivered it."""
    return DeadLetter(
        task_id=attempt.task_id,
        name=attempt.name,
        queue=attempt.queue,
        reason=reason.value,
        failure_class=failure_class.value,
        effect=attempt.effect.value,
        run_id=attempt.run_id,
        exception_type=type(exc).__qualname__ if exc is not None else "",
        error=str(exc) if exc is not None else "",
        attempts=attempts,
        worker=attempt.context.worker,
        body_completed=body_completed,
        message=message,
    )


_runtimes: weakref.WeakKeyDictionary[Any, ToolRuntime] = weakref.WeakKeyDictionary()


def runtime_for(app: Celery) -> ToolRuntime:
    """The runtime of ``app``, built once per app."""
    runtime = _runtimes.get(app)
    if runtime is None:
        runtime = ToolRuntime(app)
        _runtimes[app] = runtime
    return runtime
