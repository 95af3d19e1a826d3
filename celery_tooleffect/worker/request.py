"""``ToolRequest``: how the worker's main process ends a tool call it had to stop.

A pool child that dies (SIGKILL, OOM, ``WorkerLostError``) or hits its hard time
limit never runs task code again, so these endings are decided here:

- the journal moves to ``interrupted``, only if this delivery's attempt still
  owns it (the owner token is made here and handed to the child);
- a NON_IDEMPOTENT_WRITE whose body had started is dead-lettered
  INTERRUPTED_WRITE and never runs again;
- everything else is published again as a retry (counted against the same
  budget as failures) and dead-lettered RETRIES_EXHAUSTED once it is spent.

A failure that no tool decision produced (Celery could not store the result
after the body returned, a signal handler raised) is ended the same way, with
a journal that says the outcome was recorded acknowledged as is: Celery would
otherwise delete the message of a read whose result was never stored.

A task revoked (``revoke``, ``expires``) is announced by Celery here, which
then acknowledges its message; before that the journal and audit say how it
ended: revoked or expired before its body started, it is ``not_run`` (a later
delivery never runs it); a write terminated (``revoke(terminate=True)``, any
signal) while its body ran is dead-lettered REVOKED, stored while the message
is still held.

It also forgets, without acknowledging, a message whose attempt lost its
lease (see :class:`~celery_tooleffect.errors.LeaseLost`), and adds the failure
class to the ``task-failed`` event that Flower shows.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.exceptions import (
    Ignore,
    InvalidTaskError,
    Reject,
    Retry,
    Terminated,
    TimeLimitExceeded,
)
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu.transport.virtual.base import QoS as VirtualQoS

from ..actions.reconciling import reconciler_of
from ..effect import ToolEffect
from ..errors import (
    DeadLettered,
    InterruptedWrite,
    LeaseLost,
    RetriesExhausted,
    StoreUnavailable,
    TaskRevokedWhileRunning,
)
from ..events import AuditEvent
from ..states import DeadLetterReason, JournalState
from ..store import states
from ..store.envelope import MessageEnvelope
from ..store.runtime import ToolRuntime, runtime_for
from ..store.states import Ending
from .attempt import Attempt, forged_headers, handled_as, new_token
from .faults import crash_point
from .handoff import (
    HANDOFF_FIELD,
    Handoff,
    PendingLetter,
    exception_info,
    take_letter,
)
from .letters import begin_dead_letter, build_letter, dead_lettered, finish_dead_letter
from .strategy import check_request, in_the_loop, mark_built

logger = logging.getLogger(__name__)


class ToolRequest(Request):  # type: ignore[misc]
    """The request class of every ``ToolTask``."""

    def __init__(self, message: Any, **kwargs: Any) -> None:
        # A message of the wrong shape is refused as InvalidTaskError, which
        # the consumer step dead-letters (see celery_tooleffect.worker.strategy).
        try:
            super().__init__(message, **kwargs)
        except InvalidTaskError:
            raise
        except Exception as exc:
            raise InvalidTaskError(
                f"unreadable task message: {type(exc).__name__}: {exc}"
            ) from exc
        check_request(self._request_dict, self._payload)
        mark_built(message)
        # What this process keeps of the delivery for its own later steps. Not
        # part of the hand-off (worker/handoff.py): this object lives in the
        # worker's main process only; the pool process gets the request dict.
        #: The delivery is ended (here, or by the approval gate): once only.
        self._tooleffect_done = False
        #: The failure class the ``task-failed`` event carries.
        self._tooleffect_failure_class: str | None = None
        #: Set when a dead letter's result is the tool's own error: the
        #: ``task-failed`` event still says it is a dead letter.
        self._tooleffect_dead_letter_reason: str | None = None
        #: The pool process reported a success (Celery's ``on_success``).
        self._tooleffect_succeeded = False
        # What the pool process gets with the request (worker/handoff.py). The
        # forged headers are looked for before it is added: any tooleffect_*
        # header other than those a producer may set came from the producer
        # and is refused. On success the pool process acknowledges the
        # message, with the call's outcome when it can (the broker is the
        # store's Redis): see acknowledge().
        self.handoff = Handoff(
            token=new_token(),
            forged=tuple(forged_headers(self._request_dict)),
            ack_in_pool=self.runtime.leases.broker_ack(message.properties) is not None,
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Celery's create_request_cls (celery/worker/request.py) subclasses
        # this class per task and defines on_success there, which calls
        # acknowledge() when the call succeeded: note that it did.
        generated = cls.__dict__.get("on_success")
        if generated is None:
            return

        def on_success(self: ToolRequest, failed__retval__runtime: Any, **kwargs: Any) -> Any:
            self._tooleffect_succeeded = not failed__retval__runtime[0]
            return generated(self, failed__retval__runtime, **kwargs)

        cls.on_success = on_success

    @property
    def handoff(self) -> Handoff:
        """What this process hands the pool process with the request: one key of
        the request dict, which the pool process receives."""
        handoff: Handoff = self._request_dict[HANDOFF_FIELD]
        return handoff

    @handoff.setter
    def handoff(self, handoff: Handoff) -> None:
        self._request_dict[HANDOFF_FIELD] = handoff

    @property
    def runtime(self) -> ToolRuntime:
        return runtime_for(self._app or self.task.app)

    def _attempt(self) -> Attempt:
        fields = self._request_dict
        return Attempt.of(
            fields,
            task_id=self.id,
            name=self.name,
            effect=getattr(self.task, "tool_effect", ToolEffect.NON_IDEMPOTENT_WRITE),
            delivery_info=self.delivery_info,
            default_queue=self.runtime.settings.default_queue,
            token=self.handoff.token,
            retries=int(fields.get("retries") or 0),
        )

    def _as_recorded(self, attempt: Attempt) -> tuple[Attempt, str, bool]:
        """What the journal says of ``attempt``, of a tool that declares less than
        NON_IDEMPOTENT_WRITE: ``attempt`` under the effect it is handled as
        (:func:`handled_as`: the pool process ran it under that effect),
        the entry's state ('absent' without one), and whether this delivery's
        attempt owns the entry (running under its token).

        One read. Raises :class:`StoreUnavailable` when the entry cannot be read.
        """
        entry = self.runtime.journal.read(attempt.ref)
        state = entry.get("state") or JournalState.ABSENT.value
        owned = state == JournalState.RUNNING.value and entry.get("owner") == attempt.token
        return handled_as(attempt, entry.get("effect")), state, owned

    # -- endings decided here -------------------------------------------------

    def on_failure(
        self, exc_info: ExceptionInfo, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        if self._tooleffect_done:
            return None
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            # Only the pool's wrapper is unwrapped: a Retry carries the error
            # it retries for in ``exc`` too, and must stay a Retry.
            exc = exc.exc
        if isinstance(exc, LeaseLost):
            self._tooleffect_done = True
            worker_state.task_ready(self)
            logger.warning("%s[%s] not acknowledged: %s (another delivery holds its message)",
                           self.name, self.id, exc)
            return self._forget_delivery()
        lost_child = isinstance(exc, WorkerLostError) or (
            isinstance(exc, (SystemExit, KeyboardInterrupt))
            and not (self._already_cancelled or self._already_revoked)
        )
        if lost_child or isinstance(exc, TimeLimitExceeded):
            return self._on_interrupted(exc)
        # A dead letter the tool decided: the message is here, store it
        # (worker/handoff.py says how the letter came).
        pending = take_letter(exc_info, exc)
        if pending is not None and not self._store_decided_letter(pending):
            return None
        if pending is not None and pending.keep_result:
            # A call-id conflict: the task id's result is another call's, and
            # Celery's failure handler would overwrite it (mark_as_failure).
            self._tooleffect_done = True
            worker_state.task_ready(self)
            self.send_event("task-rejected", requeue=False)
            self.reject(requeue=False)
            return None
        if pending is not None and not isinstance(exc, DeadLettered):
            # Its result is the tool's own error: Celery's tracer stored and
            # reported it in the pool process, as for any task. End as Celery
            # ends a failure: rejected without requeue (acks_on_failure is
            # False on a tool).
            self._tooleffect_failure_class = pending.letter.failure_class
            self._tooleffect_dead_letter_reason = pending.letter.reason
            exc_info.exception = exc
            return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                      return_ok=return_ok)
        if not isinstance(exc, (Reject, Retry, Ignore, Terminated, MemoryError)):
            # Every ending a tool decides is a Retry, a Reject or an Ignore:
            # this failure came from outside its decisions (the result backend
            # could not store the result, a signal handler raised ...). Celery
            # would delete the message; the journal decides instead, as for an
            # interruption: a recorded outcome is acknowledged, a read or an
            # idempotent write runs again, a started non-idempotent write is
            # dead-lettered. (A result the backend's serializer cannot encode
            # never gets here: the pool process tries the encoding before it
            # records anything and ends the call itself, worker/results.py.)
            return self._on_interrupted(exc, why="outside_body")
        try:
            self._tooleffect_failure_class = self.runtime.classifier.classify(exc).value
        except Exception:
            self._tooleffect_failure_class = None
        # The pool wraps the exception for transport; Celery would show the
        # wrapper ("ExceptionWithTraceback()") in the task-failed event.
        exc_info.exception = exc
        return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                  return_ok=return_ok)

    def acknowledge(self) -> None:
        # A test's crash point (worker/faults.py): everything stored, not yet
        # acknowledged. Here, not in on_success: Celery's create_request_cls
        # replaces on_success with a copy that acknowledges by this method.
        crash_point("before_ack", self.name)
        if self._tooleffect_succeeded and self.handoff.ack_in_pool:
            # The pool process acknowledged it (ack_in_pool): with the outcome's
            # script, or alone after the result was stored. Only kombu's
            # bookkeeping in this process is left.
            self._forget_delivery()
            return
        super().acknowledge()

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if soft or worker_state.should_terminate:
            return super().on_timeout(soft, timeout)
        if self._tooleffect_done:
            # billiard may report the killed job to on_failure (with
            # TimeLimitExceeded) before it calls this: ended once already.
            return None
        logger.error("Hard time limit (%ss) exceeded for %s[%s]", timeout, self.name, self.id)
        return self._on_interrupted(TimeLimitExceeded(timeout))

    def send_event(self, type: str, **fields: Any) -> Any:
        if type == "task-failed" and self._tooleffect_failure_class:
            fields.setdefault("failure_class", self._tooleffect_failure_class)
        if type == "task-failed" and self._tooleffect_dead_letter_reason:
            fields.setdefault("dead_letter_reason", self._tooleffect_dead_letter_reason)
        return super().send_event(type, **fields)

    def _on_interrupted(self, exc: BaseException, why: str | None = None) -> None:
        """The child died, hit its hard limit, or failed outside the tool's decisions.

        Decided under the strictest of the effect the tool declares and the one
        its journal entry records (:meth:`_as_recorded`): the pool process of a
        worker whose release declares less runs an attempt that a stricter
        release recorded under the recorded effect, with this delivery's owner
        token, so such an attempt recorded NON_IDEMPOTENT_WRITE becomes a dead
        letter INTERRUPTED_WRITE here too, even when this release's code says
        READ_ONLY. When the entry cannot be read, which effect the attempt ran
        under is unknown: the message is kept (requeued) and its next delivery
        is settled by the journal.
        """
        self._tooleffect_done = True
        runtime = self.runtime
        attempt = self._attempt()
        why = why or ("time_limit" if isinstance(exc, TimeLimitExceeded) else "worker_lost")
        # A tool that declares NON_IDEMPOTENT_WRITE is as strict as it gets: its
        # fenced transition below is the one round trip it pays. The others read
        # the entry first (this path is rare; a read's ordinary paths pay nothing).
        owned = True
        if attempt.effect is not ToolEffect.NON_IDEMPOTENT_WRITE:
            try:
                attempt, state, owned = self._as_recorded(attempt)
            except StoreUnavailable as store_down:
                logger.error("%s[%s] interrupted (%s) and its journal cannot be read, keeping "
                             "the message for the journal to settle: %s", self.name, self.id,
                             why, store_down)
                worker_state.task_ready(self)
                self.reject(requeue=True)
                return
            if state in states.SETTLED:
                worker_state.task_ready(self)
                self.acknowledge()
                return
        failure_class = runtime.classifier.classify(exc)
        event = attempt.context.event(
            "interrupted", why, exception=exc, failure_class=failure_class.value
        )
        body_started = True
        if owned:
            try:
                moved = runtime.journal.transition(
                    attempt.ref, new_state=JournalState.INTERRUPTED,
                    allowed=states.INTERRUPT_FROM, token=attempt.token, event=event,
                    record_late=False, ending=Ending.INTERRUPTED,
                )
            except StoreUnavailable as store_down:
                # Whether the body began is unknown: assume it did (fail closed).
                logger.error("journal down while %s[%s] was interrupted: %s",
                             self.name, self.id, store_down)
            else:
                if not moved and moved.previous_state in states.SETTLED:
                    worker_state.task_ready(self)
                    self.acknowledge()
                    return
                body_started = bool(moved)
        elif attempt.effect.is_write:
            # Another attempt owns the entry, or none began: the journal settles
            # the next delivery.
            body_started = False
        else:
            runtime.audit.record_step(event)

        if (attempt.effect is ToolEffect.NON_IDEMPOTENT_WRITE and body_started
                and reconciler_of(self.task) is None):
            self._dead_letter(attempt, DeadLetterReason.INTERRUPTED_WRITE, exc, event)
        elif attempt.effect is ToolEffect.NON_IDEMPOTENT_WRITE and body_started:
            # The tool can tell whether the write happened: its next delivery
            # finds the journal interrupted and asks it (worker/interrupted.py).
            self._run_again(attempt, exc)
        elif attempt.retries >= (budget := self.task.retry_policy.budget):
            self._dead_letter(
                attempt, DeadLetterReason.RETRIES_EXHAUSTED,
                RetriesExhausted(f"{self.name}[{self.id}] not run again: interrupted ({why}) "
                                 f"after {attempt.retries} retries; its retry budget of "
                                 f"{budget} is spent"),
                event,
            )
        else:
            self._run_again(attempt, exc)

    def _announce_revoked(
        self, reason: str, terminated: bool, signum: Any, expired: bool
    ) -> Any:
        # Celery calls this when it discards a revoked or expired task (before
        # it runs) and when revoke(terminate=True) signals the pool child that
        # runs it; it then marks the task REVOKED and acknowledges the message.
        if not self._tooleffect_done:
            self._tooleffect_done = True
            try:
                kept = self._record_revoked(terminated=terminated, expired=expired,
                                            signum=signum)
            except Exception as exc:
                logger.error("%s[%s] revoked; its ending could not be recorded: %s: %s",
                             self.name, self.id, type(exc).__name__, exc)
                kept = True
            if kept:
                # The dead letter the ending needs is not stored: the message
                # stays (a later delivery settles it from the journal).
                self.reject(requeue=True)
        return super()._announce_revoked(reason, terminated, signum, expired)

    def _record_revoked(self, *, terminated: bool, expired: bool, signum: Any) -> bool:
        """Record how a revoked task ended; True when its message must be kept.

        Decided, as an interruption is, under the strictest of the declared
        effect and the one the journal entry records (:meth:`_as_recorded`):
        a READ_ONLY release's delivery of a call a stricter release recorded
        ends as that write would.
        """
        runtime = self.runtime
        attempt = self._attempt()
        if attempt.effect is not ToolEffect.NON_IDEMPOTENT_WRITE:
            try:
                attempt, _, _ = self._as_recorded(attempt)
            except StoreUnavailable as store_down:
                if attempt.effect.is_write:
                    raise  # as its transition would: the message is kept
                # A read's message is not kept for want of the journal (Celery
                # would deliver it, find it revoked and end here again, for as
                # long as the store is away); it ends without running, as a read.
                logger.error("%s[%s] revoked; whether a release recorded it as a write "
                             "cannot be read, ending it as a read: %s", self.name, self.id,
                             store_down)
        cause = "expired" if expired else "revoked"
        not_run = attempt.context.event("outcome", "not_run", cause=cause)
        if not attempt.effect.is_write:
            if terminated:
                runtime.audit.record_step(attempt.context.event(
                    "outcome", DeadLetterReason.REVOKED.value, signal=str(signum)))
            else:
                runtime.audit.record_step(not_run)
            return False
        allowed = (states.NOT_RUN_FROM if attempt.effect.safe_to_retry
                   else states.NOT_RUN_UNSAFE_FROM)
        moved = runtime.journal.transition(
            attempt.ref, new_state=JournalState.NOT_RUN, allowed=allowed, event=not_run,
            fields={"cause": cause}, record_late=False,
        )
        if moved:
            return False
        previous = moved.previous_state
        if terminated and previous == JournalState.RUNNING.value:
            # The body ran (or was about to): the write may have happened.
            stopped = TaskRevokedWhileRunning(
                f"{self.name}[{self.id}] was terminated by revoke (signal {signum}) while "
                "its body ran; the write may have happened and is not run again"
            )
            return self._store_letter(
                attempt, DeadLetterReason.REVOKED, stopped,
                attempt.context.event("outcome", DeadLetterReason.REVOKED.value,
                                      exception=stopped, signal=str(signum)),
                owned=True,
            ) is None
        if previous == JournalState.INTERRUPTED.value:
            interrupted = InterruptedWrite(
                f"{self.name}[{self.id}] started and never finished, then was {cause}; "
                "a non-idempotent write is never run twice"
            )
            return self._store_letter(
                attempt, DeadLetterReason.INTERRUPTED_WRITE, interrupted,
                attempt.context.event("outcome", DeadLetterReason.INTERRUPTED_WRITE.value,
                                      exception=interrupted),
                owned=False,
            ) is None
        # Settled already, or another delivery runs it: that one ends it.
        return False

    def _store_letter(
        self, attempt: Attempt, reason: DeadLetterReason, exc: BaseException,
        event: AuditEvent, *, owned: bool,
    ) -> DeadLettered | None:
        """Dead-letter ``attempt`` with this message, here; the rejection that ends
        the delivery, or None when the letter was not stored (keep the message)."""
        runtime = self.runtime
        failure_class = runtime.classifier.classify(exc)
        letter = build_letter(
            attempt, reason=reason, failure_class=failure_class, exc=exc,
            attempts=attempt.retries + 1, message=MessageEnvelope.of_message(self._message),
        )
        journalled = attempt.effect.is_write
        try:
            # Both steps here: this process holds the message.
            begin_dead_letter(runtime, attempt, letter, outcome_event=event, owned=owned,
                              journalled=journalled)
            finish_dead_letter(runtime, attempt, letter, journalled=journalled)
        except (StoreUnavailable, LeaseLost) as kept:
            logger.error("%s[%s] not dead-lettered (%s), keeping the message: %s",
                         self.name, self.id, reason.value, kept)
            return None
        self._tooleffect_failure_class = failure_class.value
        return dead_lettered(letter, exc)

    def _store_decided_letter(self, pending: PendingLetter) -> bool:
        """Store the letter a tool decided, with this message; False when it could
        not be stored (the message is then requeued, never deleted)."""
        letter = replace(pending.letter, message=MessageEnvelope.of_message(self._message))
        # The pool process decided under the effect the journal made it use,
        # which the letter carries (stricter than the declared one, or it).
        attempt = replace(self._attempt(), effect=ToolEffect.strictest(letter.effect))
        try:
            finish_dead_letter(self.runtime, attempt, letter, journalled=pending.journalled)
        except Exception as kept:
            # A later delivery finds the journal 'dead_lettering' and finishes it.
            logger.error("dead letter of %s[%s] not stored, requeueing the message: %s: %s",
                         self.name, self.id, type(kept).__name__, kept)
            self._tooleffect_done = True
            worker_state.task_ready(self)
            self.reject(requeue=True)
            return False
        return True

    def _dead_letter(
        self, attempt: Attempt, reason: DeadLetterReason, exc: BaseException,
        event: AuditEvent,
    ) -> None:
        """Dead-letter ``attempt`` and end this delivery (requeued when not stored)."""
        rejection = self._store_letter(
            attempt, reason, exc, event.amended(phase="outcome", status=reason.value),
            owned=False,
        )
        if rejection is None:
            worker_state.task_ready(self)
            self.reject(requeue=True)
            return
        super().on_failure(exception_info(rejection))

    def _run_again(self, attempt: Attempt, exc: BaseException) -> None:
        """Publish the task again as a retry, then acknowledge this delivery."""
        signature = self.task.signature_from_request(self._context, retries=attempt.retries + 1)
        try:
            signature.apply_async()
        except Exception as publish_failed:
            logger.error("%s[%s] not republished, requeueing: %s", self.name, self.id,
                         publish_failed)
            worker_state.task_ready(self)
            self.reject(requeue=True)
            return
        super().on_failure(exception_info(Retry(exc=exc, sig=signature)))

    def _forget_delivery(self) -> None:
        """Drop the message locally without acknowledging it on the broker:
        the pool process acknowledged it, or another delivery holds it now.

        On Redis the delivery tag is shared with the new holder of the
        message; an acknowledgement would delete the new holder's copy.

        kombu's bookkeeping is changed on the thread that owns the channel,
        as Celery's own acknowledgement is (:func:`in_the_loop`): this runs on
        a threads pool's thread when the call ends, and from there the event
        loop is woken to fetch the next message at once (it would otherwise
        sleep out its poll with the prefetch room unseen).
        """
        message = self._message
        qos = getattr(getattr(message, "channel", None), "qos", None)
        if self.runtime.settings.broker_is_redis and isinstance(qos, VirtualQoS):
            self.acknowledged = True
            in_the_loop(message)(VirtualQoS.ack, qos, message.delivery_tag)
        else:
            self.acknowledge()
