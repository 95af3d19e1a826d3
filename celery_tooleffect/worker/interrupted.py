"""An interrupted NON_IDEMPOTENT_WRITE delivered again: reconciled, or a dead letter.

``begin_attempt`` answers ``interrupted`` for a write that recorded its intent
and never its outcome (or that a rolled-back store lost): it is never run
twice without knowing. The tool's ``reconcile`` (when it has one) says
whether the write happened: applied, the call succeeds with its result;
not applied, a new attempt begins; anything else, a dead letter
``interrupted_write`` (or ``store_rolled_back``), as without it.
"""

from __future__ import annotations

import logging
import time

from celery.exceptions import Ignore
from kombu.exceptions import EncodeError

from ..actions.reconciling import ask_reconciler, reconciler_of
from ..errors import IntentNotRecorded, InterruptedWrite, LeaseLost, StoreUnavailable
from ..failures import FailureClass
from ..reconciliation import ReconcileStatus, Reconciliation
from ..states import DeadLetterReason, JournalState
from ..store import states
from ..store.audit import describe_payload
from ..store.journal import Begin
from . import telemetry
from .delivery import Delivery
from .endings import after_failure, caused, dead_letter, result_not_storable
from .results import check_storable

logger = logging.getLogger(__name__)


def reconcile(delivery: Delivery, begin: Begin) -> Reconciliation | BaseException | None:
    """Ask the tool's ``reconcile`` whether the interrupted write happened.

    Applied: the journal settles SUCCEEDED with the tool's result, returned
    (the body does not run). Not applied: None, and the caller begins a new
    attempt (the body runs, within the retry budget). Unknown, an error, a
    timeout, or no ``reconcile``: the ending, a dead letter INTERRUPTED_WRITE,
    as without it.
    """
    attempt, runtime = delivery.attempt, delivery.runtime
    if begin.detail == "store_rolled_back" and delivery.already_dead_lettered():
        # The rollback lost its journal, not its dead letter (kept by the
        # broker's Redis, or stored after the store came back): it ended.
        logger.warning("%s delivered again after a rollback of the store; it is a dead "
                       "letter already: acknowledged without running", delivery.label)
        ended: BaseException = Ignore()
        return ended
    check = reconciler_of(delivery.tool)
    reason, interrupted = interruption(delivery.label, begin.detail)
    if check is None:
        return dead_letter(
            delivery, reason,
            InterruptedWrite(f"{interrupted}; a non-idempotent write is never run twice"),
            FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
        )
    started = time.monotonic()
    answer, problem = ask_reconciler(check, delivery.tool, delivery.request, delivery.args,
                                     delivery.kwargs, timeout=runtime.settings.reconcile_timeout)
    status = ReconcileStatus.FAILED if answer is None else answer.status
    telemetry.step("reconciled", **{"tooleffect.reconcile.status": status.value})
    evidence = answer.evidence if answer is not None else f"{type(problem).__name__}"
    failure_class = None if problem is None else runtime.classifier.classify(problem)
    runtime.audit.record_step(attempt.context.event(
        "reconcile", status.value, attempt=begin.attempt,
        duration_ms=(time.monotonic() - started) * 1000.0,
        exception=problem, failure_class=failure_class,
        payload=describe_payload(runtime.settings.privacy, evidence=evidence),
    ))
    if answer is not None and answer.status is ReconcileStatus.APPLIED:
        return _settle_reconciled(delivery, answer, begin)
    if answer is not None and answer.status is ReconcileStatus.NOT_APPLIED:
        return None
    why = (f"its reconcile answered unknown ({answer.evidence or 'no evidence'})"
           if answer is not None
           else f"its reconcile failed: {type(problem).__name__}: {problem}")
    return dead_letter(
        delivery, reason,
        InterruptedWrite(f"{interrupted}, and {why}; a non-idempotent write is "
                         "never run twice without knowing"),
        FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
    )


def _settle_reconciled(delivery: Delivery, answer: Reconciliation,
                       begin: Begin) -> Reconciliation | BaseException:
    """The interrupted write happened: record its success with the tool's result
    (a result Celery cannot store ends it as the body's would); else the ending."""
    attempt = delivery.attempt
    try:
        check_storable(delivery.tool, delivery.request, answer.result)
    except EncodeError as refused:
        return result_not_storable(delivery, answer.result, refused, begin.attempt,
                                   owned=False, ran="was reconciled as applied")
    event = attempt.context.event(
        "outcome", "succeeded", attempt=begin.attempt, reconciled="1",
        payload=delivery.payload(result=answer.result),
    )
    try:
        moved = delivery.runtime.journal.transition(
            attempt.ref, new_state=JournalState.SUCCEEDED,
            allowed=states.RECONCILED_FROM, token="", event=event, ack=delivery.ack,
        )
    except StoreUnavailable as store_down:
        not_recorded = IntentNotRecorded(
            f"{delivery.label}: reconciled as applied, but that could not be recorded: "
            f"{store_down}"
        )
        if attempt.interactive:
            return caused(not_recorded, store_down)
        # Nothing ran: the next delivery reconciles again.
        return after_failure(delivery, not_recorded, FailureClass.CONNECTION,
                             attempt.retries + 1, body_started=False)
    if not moved:
        # Another delivery settled or resumed it meanwhile: that one ends it.
        return LeaseLost(f"{delivery.label}: settled by another delivery while reconciling")
    delivery.acknowledged()
    return answer


def interruption(label: str, detail: str) -> tuple[DeadLetterReason, str]:
    """The dead-letter reason of an interrupted NON_IDEMPOTENT_WRITE, and what
    is known of its earlier run, from the journal's ``detail``
    (``begin_attempt.lua``: 'failed', 'store_rolled_back', 'lease_lapsed',
    'interrupted'). Only an interactive call that raised is known to have run
    its body; otherwise the intent was recorded and whether the body started
    is not known."""
    if detail == "failed":
        return (DeadLetterReason.INTERRUPTED_WRITE,
                f"{label} raised in an earlier call and may have written")
    if detail == "store_rolled_back":
        return (DeadLetterReason.STORE_ROLLED_BACK,
                f"{label} was published before the store was found rolled back, and the "
                "store has no record of it: an earlier run may have been lost with the "
                "rollback; whether its body ran is not known")
    return (DeadLetterReason.INTERRUPTED_WRITE,
            f"{label} recorded its intent and never its outcome: whether its body "
            "started is not known")
