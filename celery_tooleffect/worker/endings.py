"""How a delivery ends when it does not succeed: retried, deferred, refused or
dead-lettered.

Each function *returns* the exception that ends the delivery (Celery's
``Retry``, ``Ignore``, ``Reject(requeue=True)``, the package's
``DeadLettered`` or ``LeaseLost``, or for an interactive call the error
itself) and its caller raises it, so every ``raise`` of the protocol is
visible in :mod:`~celery_tooleffect.worker.execution`, where the decision is
taken. Interactive runs are never retried nor dead-lettered: they end with
the error, and a write's journal settles FAILURE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from kombu.exceptions import EncodeError

from ..errors import (
    AttemptInProgress,
    AuditPersistenceFailed,
    CallIdConflict,
    LeaseLost,
    ResultNotStorable,
    RetriesExhausted,
    StoreUnavailable,
    ToolEffectError,
)
from ..events import AuditEvent
from ..failures import FailureClass, is_no_side_effect
from ..identity import conflict_text
from ..states import DeadLetterReason, JournalState
from ..store import states
from ..store.dead_letter_record import conflict_letter_id
from ..store.journal import Begin
from ..store.states import Ending
from . import telemetry
from .attempt import Attempt
from .delivery import Delivery
from .handoff import PendingLetter, attempt_notes, existing_notes
from .letters import begin_dead_letter, build_letter, dead_lettered
from .results import store_retry_first, stored_by_the_outcome
from .retries import exhausted_text

logger = logging.getLogger(__name__)


def after_failure(
    delivery: Delivery,
    exc: Exception,
    failure_class: FailureClass,
    number: int,
    *,
    body_started: bool = True,
    intent_recorded: bool = False,
    duration_ms: float | None = None,
) -> BaseException:
    """Retry, dead-letter or (interactive) re-raise ``exc``: the exception to raise.

    ``intent_recorded``: the body did not start, but this attempt's intent
    is in the journal (not durable enough to run over), so it is settled."""
    attempt = delivery.attempt
    journalled = attempt.effect.is_write and (body_started or intent_recorded)
    # A read keeps no journal: its failed body is audited here, once (a
    # dead letter's own step records it when that is the ending).
    audit_read = not attempt.effect.is_write and body_started
    outcome = attempt.context.event(
        "outcome", "failed", attempt=number, duration_ms=duration_ms, exception=exc,
        failure_class=failure_class.value, payload=delivery.payload(error=exc),
    )
    if attempt.interactive:
        if audit_read:
            delivery.runtime.audit.record_step(outcome)
        if journalled:
            # A non-idempotent write that failed may have written: it is
            # not run again under its id (a tool called in a tool's body,
            # whose parent runs again) unless it says it wrote nothing.
            not_settled = settle(delivery, JournalState.FAILED, outcome, cause=exc, fields={
                "no_side_effect": "1" if is_no_side_effect(exc) else "0"})
            if not_settled is not None:
                return not_settled
        # The class is the caller's to read (``exc.failure_class``): the error
        # is raised to it, in this process. Audited: noted for the
        # task_failure handler, in this process too (worker/handoff.py).
        exc.__dict__.setdefault("failure_class", failure_class.value)
        attempt_notes(delivery.request).audited = exc
        return exc
    notes = existing_notes(delivery.request)
    spent_by_retry = notes.retries_spent if notes is not None else None
    if spent_by_retry is not None and spent_by_retry[0] is exc:
        requested_limit = spent_by_retry[1]
        # self.retry() found the budget spent and raised the tool's error.
        spent = RetriesExhausted(
            f"{delivery.label} asked for a retry (self.retry()) after "
            f"{attempt.retries} retries; its retry budget of {requested_limit} is spent. "
            f"Last error: {type(exc).__name__}: {exc}"
        )
        # Celery's result is what its retry() raised, as in plain Celery.
        return dead_letter(
            delivery, DeadLetterReason.RETRIES_EXHAUSTED, spent, failure_class,
            owned=journalled, attempts=number, outcome_event=outcome, error=_error_for_result(exc),
        )
    decision = delivery.policy.after_failure(
        exc, failure_class, retries=attempt.retries, attempt=number,
        body_started=body_started,
    )
    if decision.retry:
        # RETRY stored before another delivery may begin (the journal
        # leaves 'running') and before the retry is published.
        retry_stored = store_retry_first(delivery.tool, delivery.request, exc)
        if audit_read:
            delivery.runtime.audit.record_step(outcome)
        if journalled:
            retrying = outcome.amended(status="retrying", countdown=decision.countdown)
            not_settled = settle(delivery, JournalState.RETRY_SCHEDULED, retrying, cause=exc,
                                 ending=Ending.FAILED)
            if isinstance(not_settled, AuditPersistenceFailed):
                return dead_letter(
                    delivery, DeadLetterReason.NOT_RETRYABLE, not_settled, FailureClass.UNKNOWN,
                    owned=True, attempts=number,
                )
            if not_settled is not None:
                return not_settled
        return publish_retry(delivery, exc, decision.countdown, retry_stored=retry_stored)
    reason = (DeadLetterReason.RETRIES_EXHAUSTED if decision.exhausted
              else DeadLetterReason.NOT_RETRYABLE)
    return dead_letter(
        delivery, reason, exc, failure_class, owned=journalled, attempts=number,
        outcome_event=outcome, error=_error_for_result(exc),
    )


def settle(
    delivery: Delivery, state: JournalState, event: AuditEvent, *,
    cause: BaseException, ending: Ending | None = None,
    fields: Mapping[str, str] | None = None,
) -> BaseException | None:
    """Record a failed attempt's outcome: None when recorded; else its ending,
    failing closed (``AuditPersistenceFailed``: it could not be stored;
    ``LeaseLost``: another delivery owns the entry now)."""
    attempt = delivery.attempt
    try:
        moved = delivery.runtime.journal.transition(
            attempt.ref, new_state=state, allowed=states.SETTLE_FROM,
            token=attempt.token, event=event, ending=ending, fields=fields,
        )
    except StoreUnavailable as store_down:
        return caused(AuditPersistenceFailed(
            f"{delivery.label} failed ({type(cause).__name__}) and its "
            f"outcome could not be recorded: {store_down}"
        ), cause)
    if not moved and not attempt.interactive:
        return LeaseLost(f"{delivery.label} failed after losing its lease")
    return None


def publish_retry(delivery: Delivery, exc: Exception, countdown: float, *,
                  retry_stored: bool) -> BaseException:
    """Publish the retry: Celery's ``Retry``, or, when the publish fails, a
    ``Reject`` that keeps the message (never a deleting one).
    ``retry_stored``: :func:`store_retry_first` stored RETRY already."""
    request = delivery.request
    signature = delivery.tool.signature_from_request(
        request, countdown=countdown, retries=int(request.retries or 0) + 1
    )
    kept = sent_again(delivery, "retry", signature.apply_async, cause=exc)
    if kept is not None:
        return kept
    if retry_stored:
        stored_by_the_outcome(request)
    telemetry.step("retry scheduled", **{"tooleffect.countdown": countdown})
    retry: BaseException = Retry(exc=exc, when=countdown, sig=signature)
    return retry


def send_held_retry(delivery: Delivery, cause: BaseException | None) -> BaseException | None:
    """Send the retry the tool's ``self.retry()`` asked for, held until now
    (``AttemptNotes.holding_retry``): None when sent or when none is held; a
    ``Reject`` that keeps the message when the publish fails (``cause``: what
    the ending is caused by, the tool's ``Retry``)."""
    notes = existing_notes(delivery.request)
    held = notes.held_retry if notes is not None else None
    if notes is None or held is None:
        return None
    notes.held_retry = None
    return sent_again(delivery, "retry",
                      lambda: delivery.tool.apply_async(held.args, held.kwargs, **held.options),
                      cause=cause)


def sent_again(delivery: Delivery, what: str, publish: Callable[[], object], *,
               cause: BaseException | None = None) -> BaseException | None:
    """Publish this call again (``publish()``: a retry, a deferral): None once
    sent; else a ``Reject`` that requeues the message held now, so that a
    publish that fails never loses the call (Celery's ``Reject(requeue=True)``
    with ``acks_late``: the message goes back to its queue), caused by
    ``cause`` when given."""
    try:
        publish()
    except Exception as publish_failed:
        logger.error("%s of %s not published, requeueing: %s", what, delivery.label,
                     publish_failed)
        kept = Reject(publish_failed, requeue=True)
        return kept if cause is None else caused(kept, cause)
    return None


def defer_to_owner(delivery: Delivery, begin: Begin) -> BaseException:
    """A live owner runs this task: republish for when its lease ends."""
    attempt, settings = delivery.attempt, delivery.runtime.settings
    wait = max(begin.owner_lease_end - time.time(), 0.0) + 1.0
    if settings.broker_is_redis:
        # A countdown longer than the visibility timeout would be restored
        # while it waits; come back sooner and look again.
        wait = min(wait, 0.8 * settings.visibility_timeout)
    else:
        # RabbitMQ closes the channel of a consumer that holds a message
        # unacknowledged past consumer_timeout (the waiting copy is held
        # so until its countdown ends): come back well before.
        wait = min(wait, 0.25 * settings.rabbitmq_consumer_timeout)
    if attempt.interactive:
        return AttemptInProgress(f"{delivery.label} is running elsewhere for {wait:.0f}s more")
    signature = delivery.tool.signature_from_request(delivery.request, countdown=wait)
    kept = sent_again(delivery, "deferral", signature.apply_async)
    if kept is not None:
        return kept
    telemetry.step("deferred", **{"tooleffect.countdown": wait})
    delivery.runtime.audit.record_step(
        attempt.context.event("deferred", "owned_elsewhere", countdown=f"{wait:.1f}")
    )
    acknowledged: BaseException = Ignore()
    return acknowledged


def conflict(delivery: Delivery, begin: Begin) -> BaseException:
    """The task id is another call's: refused, changing nothing of that call.

    Interactive: the refusal. Queued: a dead letter ``call_id_conflict`` under
    an id of its own, the journal untouched, and no result stored (the task
    id's result is the first call's)."""
    attempt = delivery.attempt
    which = "tool" if begin.detail == "tool" else "arguments"
    refused = CallIdConflict(
        conflict_text(attempt.task_id, attempt.name, begin.recorded_tool, which),
        task_id=attempt.task_id, tool=attempt.name, recorded_tool=begin.recorded_tool,
        conflict=which,
    )
    if attempt.interactive:
        return refused
    return dead_letter(
        delivery, DeadLetterReason.CALL_ID_CONFLICT, refused, FailureClass.CLIENT_ERROR,
        owned=False, attempts=0, journalled=False,
        letter_id=conflict_letter_id(attempt.task_id, delivery.digest()), keep_result=True,
    )


def exhausted(delivery: Delivery, begin: Begin) -> BaseException:
    """Earlier attempts spent the retry budget (the journal counted how they
    ended): a dead letter ``retries_exhausted`` saying what spent it."""
    return dead_letter(
        delivery, DeadLetterReason.RETRIES_EXHAUSTED,
        RetriesExhausted(exhausted_text(
            delivery.tool.name, delivery.attempt.task_id, attempts=begin.attempt,
            budget=delivery.policy.budget, endings=begin.endings or {},
        )),
        FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
    )


def resume_dead_letter(delivery: Delivery, begin: Begin) -> BaseException:
    """A dead letter was begun but not finished: finish it with its recorded reason
    (:func:`~celery_tooleffect.worker.letters.finish_dead_letter` is the main
    process's last step of every letter)."""
    journal = delivery.runtime.journal.read(delivery.attempt.ref)
    try:
        reason = DeadLetterReason.coerce(journal.get("reason", ""))
    except ValueError:
        reason = DeadLetterReason.NOT_RETRYABLE
    failure_class = FailureClass.coerce(journal.get("failure_class") or "unknown")
    pending = AuditPersistenceFailed(
        f"{delivery.label}: finishing a dead letter begun earlier "
        f"({journal.get('exception_type', '')})",
        body_completed=journal.get("body_completed") == "1",
    )
    return dead_letter(
        delivery, reason, pending, failure_class, owned=False, attempts=begin.attempt,
        body_completed=pending.body_completed, allowed=states.FINISH_DEAD_LETTER_FROM,
    )


def result_not_storable(
    delivery: Delivery, result: Any, refused: EncodeError, number: int, *,
    duration_ms: float | None = None, owned: bool = True, ran: str = "ran",
) -> BaseException:
    """The body returned a result the result backend's serializer cannot
    encode (or, ``ran`` says so, a reconcile found the write applied with
    one): the call ran once and ends here, a dead letter ``not_retryable``.
    A write's letter says its body completed (a replay is refused without
    ``--force``: it would write again) and its journal records that it
    ran: ``dead_lettered``, never interrupted, so no reconciler is asked
    and no delivery runs it again. A read's letter replays as any read's
    (once the tool is fixed, it answers). Celery's result is the
    :class:`ResultNotStorable` naming the type and the encoder's error.
    ``owned``: this attempt runs under its owner token (not a reconciled
    one)."""
    type_name = _type_name(result)
    serializer = getattr(getattr(delivery.tool, "backend", None), "serializer", None) or "json"
    failed = caused(ResultNotStorable(
        f"{delivery.label} {ran}, but its result cannot be stored: the result serializer "
        f"{serializer!r} cannot encode a {type_name}: {type(refused).__name__}: {refused}. "
        f"The tool must return a value {serializer!r} can encode",
        result_type=type_name,
    ), refused)
    return dead_letter(
        delivery, DeadLetterReason.NOT_RETRYABLE, failed, FailureClass.UNKNOWN,
        owned=owned, attempts=number, body_completed=delivery.attempt.effect.is_write,
        error=failed,
        outcome_event=delivery.attempt.context.event(
            "outcome", "result_not_stored", attempt=number,
            duration_ms=duration_ms, exception=failed,
            failure_class=FailureClass.UNKNOWN.value,
            payload=delivery.payload(error=failed),
        ),
    )


def dead_letter(
    delivery: Delivery,
    reason: DeadLetterReason,
    exc: BaseException,
    failure_class: FailureClass,
    *,
    owned: bool,
    attempts: int,
    body_completed: bool = False,
    outcome_event: AuditEvent | None = None,
    allowed: frozenset[JournalState] | None = None,
    journalled: bool = True,
    letter_id: str | None = None,
    error: BaseException | None = None,
    keep_result: bool = False,
) -> BaseException:
    """Decide the dead letter of a queued run (``exc`` itself for an interactive one).

    The journal moves to ``dead_lettering`` here; the ``DeadLettered``
    returned carries the letter to the worker's main process, which holds
    the message: ``ToolRequest`` stores it with the message as delivered,
    then rejects the message (see :mod:`celery_tooleffect.worker.letters`
    and :mod:`~celery_tooleffect.worker.handoff`). ``error``: the exception
    Celery's result shows (the body's), when the failure is not the
    package's own; ``keep_result``: the task id's result is another
    call's, and stays as it is.
    """
    attempt = delivery.attempt
    if attempt.interactive:
        return exc
    letter = build_letter(
        attempt, reason=reason, failure_class=failure_class, exc=exc,
        attempts=attempts, body_completed=body_completed,
    )
    if letter_id is not None:
        letter = replace(letter, task_id=letter_id)
    event = outcome_event or attempt.context.event(
        "outcome", reason.value, attempt=attempts or None, exception=exc,
        failure_class=failure_class.value,
    )
    journalled = journalled and attempt.effect.is_write
    begin_dead_letter(delivery.runtime, attempt, letter, outcome_event=event, owned=owned,
                      allowed=allowed, journalled=journalled)
    pending = PendingLetter(replace(letter, message=None), journalled, keep_result)
    telemetry.step("dead-lettered", **{"tooleffect.dead_letter.reason": reason.value})
    return caused(dead_lettered(letter, exc, pending_letter=pending, error=error), exc)


def requested_retry_event(attempt: Attempt, number: int, requested: Retry) -> AuditEvent:
    """The audit event of a retry the tool asked for (``self.retry()``)."""
    cause = requested.exc if isinstance(requested.exc, BaseException) else None
    countdown = requested.when if isinstance(requested.when, (int, float)) else None
    return attempt.context.event("outcome", "retrying", attempt=number, exception=cause,
                                 requested="1", countdown=countdown)


def caused(ending: BaseException, cause: BaseException) -> BaseException:
    """``ending`` as ``raise ending from cause`` leaves it."""
    ending.__cause__ = cause
    ending.__suppress_context__ = True
    return ending


def _error_for_result(exc: BaseException) -> BaseException | None:
    """What Celery's result shows for a dead letter caused by ``exc``: ``exc``
    when the tool's body raised it; None (the ``DeadLettered`` itself) when it
    is the package's own (a store that did not answer, a lease not secured)."""
    return None if isinstance(exc, ToolEffectError) else exc


def _type_name(value: Any) -> str:
    """The name of ``value``'s type, with its module unless a builtin's."""
    kind = type(value)
    return (kind.__qualname__ if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}")
