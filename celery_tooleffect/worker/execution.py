"""How one call of a tool runs: the protocol ``ToolTask.__call__`` hands over to.

``ToolTask`` declares a tool; this module runs it, as Celery's ``app/trace.py``
runs a ``Task``. For a write, in this order: secure the lease, record the
intent (or do not run), run the body under a heartbeat, record the outcome (or
fail closed). For a failure: classify it with the original exception, then
retry, dead-letter or (interactive runs) raise.

Every way a call ends early is an exception: Celery's ``Ignore`` (acknowledge,
nothing to store), ``Retry`` (published again), ``Reject(requeue=True)``
(keep the message), and the package's ``DeadLettered`` (carries the letter to
the worker's main process, which stores it with the message) and
``LeaseLost`` (forget the delivery). The methods and functions that decide
an ending (most in :mod:`~celery_tooleffect.worker.endings`) *return* it and
the caller raises it, so every ``raise`` of the protocol is visible here,
where the decision is taken. What ``begin_attempt``'s verdict makes a
delivery do is :func:`~celery_tooleffect.store.states.delivery_action`; an
interrupted write delivered again is :mod:`~celery_tooleffect.worker.interrupted`.

Interactive runs (``apply()``, eager mode, a direct call) are journalled like
queued ones but never retried and never rejected: they raise, and settle
FAILURE.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import redis
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from kombu.exceptions import EncodeError

from ..actions.showing import show_call
from ..errors import (
    ApprovalRequired,
    AuditPersistenceFailed,
    EffectRelabelRefused,
    IntentNotDurable,
    IntentNotRecorded,
    LeaseLost,
    LeaseNotSecured,
    StoreUnavailable,
)
from ..failures import FailureClass
from ..identity import publish_digest
from ..reconciliation import Reconciliation
from ..states import ApprovalState, DeadLetterReason, JournalState
from ..store import states
from ..store.journal import Begin
from ..store.leases import Leases, LeaseVerdict
from ..store.states import DeliveryAction, Ending, Verdict, delivery_action
from . import telemetry
from .attempt import forged_headers
from .children import KeptResult, body_of, keep_result_in_journal, kept_result
from .delivery import Delivery, Tool, run_signature, tool_body
from .endings import (
    after_failure,
    conflict,
    dead_letter,
    defer_to_owner,
    exhausted,
    requested_retry_event,
    result_not_storable,
    resume_dead_letter,
    send_held_retry,
    settle,
)
from .faults import crash_point
from .handoff import attempt_notes, existing_notes, handoff_of
from .heartbeat import Heartbeat, LeasePlan, plan_leases
from .interrupted import reconcile
from .results import result_for_outcome, store_retry_first, stored_by_the_outcome
from .telemetry import tool_call_span

logger = logging.getLogger(__name__)


def run_tool(tool: Tool, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one call of ``tool``: its result, or the exception that ends it."""
    return Execution(tool, request, args, kwargs).run()


class Execution(Delivery):
    """One attempt of one tool call, from the message check to its ending."""

    def run(self) -> Any:
        # One span per call when OpenTelemetry is installed (worker/telemetry.py).
        with tool_call_span(self.attempt, privacy=self.runtime.settings.privacy,
                            args=self.args, kwargs=self.kwargs,
                            classify=self.runtime.classifier.classify) as span:
            self._check_message()
            if not self.attempt.effect.is_write and not self._recorded_as_write():
                return span.succeeded(self._run_read_only())
            refused = self._check_approval()
            if refused is not None:
                raise refused
            return span.succeeded(self._run_write())

    def _recorded_as_write(self) -> bool:
        """Whether a READ_ONLY call delivered again is recorded in the journal
        as a write (by a release that declares the tool a write): then it is
        handled under the recorded effect (the strictest effect wins,
        docs/identity.md).

        Only a delivery that may not be the call's first asks (a redelivery, a
        retry, a deferral, a replay: ``Attempt.again``), so a read's first
        delivery pays no round trip for this. A journal that cannot be read
        leaves the question open: the call is not run now.
        """
        attempt = self.attempt
        if not attempt.again or attempt.interactive:
            return False
        try:
            recorded = self.runtime.journal.recorded_effect(attempt.ref)
        except StoreUnavailable as store_down:
            failed = IntentNotRecorded(
                f"{self.label} not run: delivered again, and whether a release recorded it as a "
                f"write cannot be read: {store_down}"
            )
            raise after_failure(
                self, failed, FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
            ) from None
        # Declared READ_ONLY, the weakest: handled as recorded, if it was recorded.
        self.handle_as(recorded)
        return self.attempt.effect.is_write

    def _check_approval(self) -> ApprovalRequired | None:
        """Run a call that needs approval only when the store says it was
        approved: None, or the refusal that ends it.

        A queued call was let through by the worker's main process, which
        asked the store (worker/approval_gate.py) and said so in its hand-off; an
        interactive call cannot be parked, so it asks here and is refused
        unless approved.
        """
        if not self.tool.needs_approval(self.args, self.kwargs):
            return None
        if self.handoff is not None and self.handoff.approved and not self.attempt.interactive:
            return None
        state, digest = self.runtime.approvals.decision(self.attempt.run_id,
                                                        self.attempt.task_id)
        if state is ApprovalState.APPROVED and (
                not digest or digest == show_call(self.tool, self.args, self.kwargs).digest):
            return None
        return ApprovalRequired(
            f"{self.label} needs a person's approval ({state.value}): queue it with "
            "apply_async and approve it (celery tooleffect approvals approve)"
        )

    def _check_message(self) -> None:
        """Refuse forged headers and arguments the tool cannot take, before anything runs."""
        # Queued messages were checked by the worker's main process; an
        # interactive call carries its headers on the request.
        forged = (list(self.handoff.forged) if self.handoff is not None
                  else forged_headers(_message_headers(self.request)))
        problem: BaseException | None = None
        if forged:
            problem = EffectRelabelRefused(
                f"message sets reserved header(s) {', '.join(forged)}; "
                "a producer may set only tooleffect_run_id"
            )
        else:
            try:
                run_signature(self.tool).bind(*self.args, **self.kwargs)
            except TypeError as exc:
                problem = TypeError(f"{self.tool.name}: invalid arguments: {exc}")
        if problem is None:
            return
        if self.attempt.interactive:
            raise problem
        # Arguments the body cannot take: Celery's result is the TypeError, as
        # calling the body would raise; a forged header is the package's refusal.
        raise dead_letter(
            self, DeadLetterReason.MALFORMED_MESSAGE, problem, FailureClass.CLIENT_ERROR,
            owned=False, attempts=0, journalled=False,
            error=problem if isinstance(problem, TypeError) else None,
        )

    # -- the two protocols ---------------------------------------------------

    def _run_read_only(self) -> Any:
        attempt, runtime = self.attempt, self.runtime
        number = attempt.retries + 1
        started = time.monotonic()
        for boundary in ("before_intent", "after_intent", "in_body"):  # a read has no intent
            crash_point(boundary, attempt.name)
        try:
            with body_of(attempt.task_id, attempt.run_id, attempt.caller):
                result = tool_body(self.tool)(*self.args, **self.kwargs)
            crash_point("before_outcome", attempt.name)
        except Retry as requested:
            runtime.audit.record_step(requested_retry_event(attempt, number, requested))
            raise
        except (Ignore, Reject):
            raise
        except Exception as exc:
            # The failed outcome is audited once, by the ending after_failure
            # decides (a retry, a dead letter, or raised when interactive).
            failure_class = runtime.classifier.classify(exc)
            raise after_failure(self, exc, failure_class, number,
                                duration_ms=_ms_since(started))
        # Celery's result rides in the audit append when the result backend is
        # the store's Redis (worker/results.py); a read's audit is fail-soft,
        # so when the append fails the result is left to Celery.
        try:
            stored = None if attempt.interactive else result_for_outcome(
                self.tool, self.request, result, runtime)
        except EncodeError as refused:
            raise result_not_storable(self, result, refused, number,
                                      duration_ms=_ms_since(started)) from None
        if not runtime.audit.record_step(
            attempt.context.event(
                "outcome", "succeeded", attempt=number, duration_ms=_ms_since(started),
                payload=self.payload(result=result),
            ),
            result=stored,
            ack=self.ack,
        ):
            telemetry.audit_write_failed("read", attempt.effect.value)
        else:
            self.acknowledged()
            if stored is not None:
                stored_by_the_outcome(self.request)
        return result

    def _outcome_not_recorded(self, store_down: StoreUnavailable,
                              number: int) -> BaseException:
        """What ends a write whose body ran and whose outcome the store did
        not take: fail closed (an interactive call raises it as is)."""
        attempt = self.attempt
        telemetry.audit_write_failed("write", attempt.effect.value)
        failed = AuditPersistenceFailed(
            f"{self.label} ran, but its outcome could not be recorded: {store_down}",
            body_completed=True,
        )
        if attempt.interactive:
            return failed
        return dead_letter(
            self, DeadLetterReason.NOT_RETRYABLE, failed, FailureClass.UNKNOWN,
            owned=True, attempts=number, body_completed=True,
            outcome_event=attempt.context.event(
                "outcome", "audit_failed", attempt=number, exception=failed,
                failure_class=FailureClass.UNKNOWN.value,
            ),
        )

    def _run_write(self) -> Any:
        attempt, runtime = self.attempt, self.runtime
        crash_point("before_intent", attempt.name)
        plan = self._lease_plan()
        begin = self._begin(plan)
        if isinstance(begin, Reconciliation):
            return begin.result  # the interrupted attempt's write happened
        if isinstance(begin, KeptResult):
            return begin.value  # a child that ran in an earlier attempt of its parent
        attempt = self.attempt  # the effect it is handled under may be stricter
        # What the body reads as self.fencing_token.
        attempt_notes(self.request).fencing_token = begin.fencing_token
        telemetry.step("intent recorded", **{"tooleffect.fencing_token": begin.fencing_token})
        crash_point("after_intent", attempt.name)
        number = begin.attempt
        started = time.monotonic()
        try:
            try:
                with self._heartbeat(plan), \
                        body_of(attempt.task_id, attempt.run_id, attempt.caller):
                    crash_point("in_body", attempt.name)
                    result = tool_body(self.tool)(*self.args, **self.kwargs)
                    crash_point("before_outcome", attempt.name)
            except BaseException:
                # The intent's global-stream copy normally rides with the
                # outcome (one round trip less); on a failure it goes alone.
                if begin.intent_event is not None:
                    runtime.audit.copy_to_global(begin.intent_event)
                raise
        except Retry as requested:
            # The tool called self.retry(): the attempt ends here, by choice.
            # Celery built the retry, and ToolTask.apply_async held it: RETRY
            # is stored, then the journal leaves 'running', then it is sent, so
            # that it never begins while this attempt still runs.
            retry_stored = not attempt.interactive and store_retry_first(
                self.tool, self.request, requested)
            not_settled = settle(
                self, JournalState.RETRY_SCHEDULED,
                requested_retry_event(attempt, number, requested),
                cause=requested, ending=Ending.REQUESTED,
                fields=self._retried_with(requested),
            )
            if not_settled is not None:
                raise not_settled  # the held retry is not sent: this ending decides
            unsent = send_held_retry(self, requested)
            if unsent is not None:
                raise unsent
            if retry_stored:
                stored_by_the_outcome(self.request)
            raise
        except (Ignore, Reject):
            self._send_swallowed_retry()
            raise
        except Exception as exc:
            failure_class = runtime.classifier.classify(exc)
            ending = after_failure(self, exc, failure_class, number,
                                   duration_ms=_ms_since(started))
            self._send_swallowed_retry()
            raise ending
        event = attempt.context.event(
            "outcome", "succeeded", attempt=number, duration_ms=_ms_since(started),
            payload=self.payload(result=result),
        )
        # Celery's result, stored by the outcome's script when the result
        # backend is the store's Redis (worker/results.py).
        try:
            stored = None if attempt.interactive else result_for_outcome(
                self.tool, self.request, result, runtime)
        except EncodeError as refused:
            if begin.intent_event is not None:
                runtime.audit.copy_to_global(begin.intent_event)
            raise result_not_storable(self, result, refused, number,
                                      duration_ms=_ms_since(started)) from None
        try:
            # SUCCEED_FROM includes 'absent': see its comment.
            moved = bool(runtime.journal.transition(
                attempt.ref, new_state=JournalState.SUCCEEDED,
                allowed=states.SUCCEED_FROM, token=attempt.token, event=event,
                earlier_copy=begin.intent_event, result=stored, ack=self.ack,
                fields=(keep_result_in_journal(self.tool, result, self.label)
                        if attempt.interactive else None),
            ))
        except StoreUnavailable as store_down:
            # The script may have run and only its reply been lost (a Redis
            # that restarts from an fsynced AOF): read what the store holds
            # before failing closed.
            if attempt.interactive or not outcome_landed(runtime, attempt):
                raise self._outcome_not_recorded(store_down, number) from store_down
            moved = True
        self._send_swallowed_retry()
        if not moved:
            # Another delivery owns the entry now; the outcome was stored as a
            # late_outcome, and the dead letter (if any) gets a copy of it.
            runtime.dead_letters.record_late_outcome(attempt.task_id, event)
            if not attempt.interactive:
                raise LeaseLost(f"{self.label} finished after losing its lease")
        else:
            self.acknowledged()
            if stored is not None:
                stored_by_the_outcome(self.request)
        return result

    def _send_swallowed_retry(self) -> None:
        """Send a retry the body asked for and then did not raise (it caught
        Celery's ``Retry``), as Celery would have, once the attempt's ending is
        recorded (so that it does not find the attempt still running)."""
        unsent = send_held_retry(self, None)
        if unsent is not None:
            logger.warning("%s: the retry its body asked for and caught was not sent (%s)",
                           self.label, unsent)

    # -- before the body -------------------------------------------------------

    def _lease_plan(self) -> LeasePlan:
        """The write's leases (:func:`plan_leases`); with a deadline, the broker
        lease secured until it before anything is recorded: here, or by the
        intent's own script when the broker is the store's Redis (:meth:`_begin`)."""
        attempt, runtime = self.attempt, self.runtime
        plan = plan_leases(runtime.settings, self.tool.operation_deadline)
        deadline_end = plan.deadline_end
        if deadline_end is None or attempt.interactive:
            return plan
        lease = runtime.leases.broker_lease(self.request.properties)
        if lease is None:
            return plan
        if runtime.leases.reaches_the_broker:
            return replace(plan, broker_lease=lease, lease_with_intent=True)
        verdict = runtime.leases.extend_lease(lease, deadline_end)
        if verdict is LeaseVerdict.OK:
            telemetry.step("lease secured", **{"tooleffect.lease_until": deadline_end})
            return replace(plan, broker_lease=lease)
        raise self._lease_refused(verdict, deadline_end)

    def _lease_refused(self, verdict: LeaseVerdict, deadline_end: float) -> BaseException:
        """The ending of a write whose broker lease could not be secured."""
        attempt, runtime = self.attempt, self.runtime
        audited = runtime.audit.record_step(
            attempt.context.event("lease_refused", verdict.value, lease_until=f"{deadline_end:.3f}")
        )
        # A delivery that records nothing else leaves a trace here, whatever
        # the store says: the audit event, and a log line naming the task.
        logger.warning("%s: broker lease %s before the write began (%s); not run by this "
                       "delivery", self.label, verdict.value,
                       "audited" if audited else "its audit event was not stored")
        if verdict is LeaseVerdict.LOST:
            # The message was restored: its other copy will run. Acknowledging
            # ours would delete that copy's lease (the delivery tag is shared).
            return LeaseLost(f"{self.label}: message restored before it began")
        not_secured = LeaseNotSecured(f"{self.label} not run: lease not secured ({verdict.value})")
        return after_failure(
            self, not_secured, FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
        )

    def _heartbeat(self, plan: LeasePlan) -> contextlib.AbstractContextManager[Any]:
        """The heartbeat of a write whose plan has one; nothing for the others."""
        if plan.interval is None:
            return contextlib.nullcontext()
        attempt, runtime = self.attempt, self.runtime

        span = telemetry.current_span()

        def lease_failed(why: str) -> None:
            logger.warning("%s: lease extension failed (%s)", self.label, why)
            telemetry.lease_extended(span, ok=False, reason=why)
            runtime.audit.record_step(attempt.context.event("lease_extension_failed", why))

        return Heartbeat(
            journal=runtime.journal, ref=attempt.ref, token=attempt.token,
            leases=runtime.leases, broker_lease=plan.broker_lease,
            deadline_end=plan.deadline_end, interval=plan.interval, on_failure=lease_failed,
            on_renewed=(lambda: telemetry.lease_extended(span, ok=True))
            if telemetry.ENABLED else None,
        )

    def _begin(
        self, plan: LeasePlan, *, resume: bool = False,
    ) -> Begin | Reconciliation | KeptResult:
        """Record the intent of a write, or end this delivery without running it;
        for an interrupted NON_IDEMPOTENT_WRITE whose tool reconciles, what its
        ``reconcile`` found applied (``resume``: it found the write not applied)."""
        attempt, runtime = self.attempt, self.runtime
        lease_note = {} if plan.broker_lease is None else {
            "lease_until": f"{plan.deadline_end:.3f}"
        }
        with_intent = plan.broker_lease if plan.lease_with_intent else None
        deadline_end = plan.deadline_end or 0.0
        intent = attempt.context.event(
            "intent", "started", payload={**self.payload(), **lease_note},
            idempotency_key=attempt.idempotency_key,
        )
        try:
            for _ in range(Leases.BUSY_RETRIES):
                begin = runtime.journal.begin_attempt(
                    attempt.ref,
                    token=attempt.token,
                    effect=attempt.effect.value,
                    lease_end=plan.journal_lease_end,
                    attempts_allowed=self.policy.attempts_allowed,
                    tool=attempt.name,
                    call_digest=self.digest(),
                    resume_interrupted=resume,
                    event=intent,
                    broker_lease=with_intent,
                    broker_lease_end=deadline_end,
                    sent_at=attempt.sent_at,
                    # A broker that is not rolled back with the store knows
                    # whether it delivered the message before (RabbitMQ's
                    # redelivered, kombu's restore on another Redis); a direct
                    # call is made now.
                    first_delivery=attempt.interactive or not (
                        attempt.again or runtime.settings.broker_rolls_back_with_store),
                )
                # kombu's restore sweep holds its mutex for a moment: wait it
                # out, as Leases.extend_lease does (nothing was recorded).
                if begin.verdict is not Verdict.LEASE_BUSY:
                    break
                time.sleep(Leases.BUSY_WAIT)
        except IntentNotDurable as not_durable:
            # The intent is on the primary only: the body must not run over it.
            # The attempt is ours: it ends as a failure before the body (so a
            # retry may begin again), counted against the retry budget.
            logger.warning("%s not run: %s", self.label, not_durable)
            raise after_failure(
                self, IntentNotDurable(f"{self.label} not run: {not_durable}"),
                FailureClass.CONNECTION, not_durable.attempt, body_started=False,
                intent_recorded=True,
            )
        except StoreUnavailable as store_down:
            failed = IntentNotRecorded(
                f"{self.label} not run: its intent could not be recorded: {store_down}"
            )
            if attempt.interactive:
                raise failed from store_down
            if self.already_ended() or self.already_dead_lettered():
                logger.warning("%s delivered again after it ended; acknowledged without "
                               "running (not audited: %s)", self.label, store_down)
                raise Ignore() from None
            raise after_failure(
                self, failed, FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
            )

        self.handle_as(begin.effect)
        action = delivery_action(begin.verdict, interactive=attempt.interactive,
                                 kept_result=bool(begin.kept_content_type))
        if action is DeliveryAction.RUN:
            if with_intent is not None:
                telemetry.step("lease secured", **{"tooleffect.lease_until": deadline_end})
            return begin
        if action is DeliveryAction.RETURN_KEPT:
            return KeptResult(kept_result(begin))
        if action is DeliveryAction.END_QUIETLY:
            raise Ignore()
        if action is DeliveryAction.RECONCILE:
            found = reconcile(self, begin)
            if found is None:  # the write was not applied: a new attempt begins
                return self._begin(plan, resume=True)
            if isinstance(found, BaseException):
                raise found
            return found
        raise self._refused(action, begin, deadline_end)

    def _refused(self, action: DeliveryAction, begin: Begin, deadline_end: float) -> BaseException:
        """The ending of a delivery its verdict does not let run."""
        if action is DeliveryAction.REFUSE_CONFLICT:
            return conflict(self, begin)
        if action is DeliveryAction.LEASE_LOST:
            return self._lease_refused(LeaseVerdict.LOST, deadline_end)
        if action is DeliveryAction.LEASE_BUSY:
            return self._lease_refused(LeaseVerdict.BUSY, deadline_end)
        if action is DeliveryAction.DEFER:
            return defer_to_owner(self, begin)
        if action is DeliveryAction.FINISH_DEAD_LETTER:
            return resume_dead_letter(self, begin)
        return exhausted(self, begin)  # DEAD_LETTER_EXHAUSTED

    def _retried_with(self, requested: Retry) -> dict[str, str] | None:
        """The new digest of a retry the tool asked for with other arguments
        (``self.retry(args=...)``): its own decision, so it is the same call."""
        sig = getattr(requested, "sig", None)
        if sig is None:
            return None
        args, kwargs = tuple(sig.args or ()), dict(sig.kwargs or {})
        if args == tuple(self.args) and kwargs == self.kwargs:
            return None
        return {"call_digest": publish_digest(args, kwargs, self.serializer)}


def acknowledge_success(tool: Tool, request: Context) -> None:
    """Acknowledge a successful call's message from the pool process, when the
    main process asked for that (``Handoff.ack_in_pool``) and no script of the
    call carried it (a read whose audit append failed, a result kept from an
    earlier attempt): alone, now that Celery stored the result. Called by
    ``ToolTask.after_return``, which Celery's tracer calls after it stored it.

    The main process acknowledges nothing on success (``ToolRequest``), so a
    message this cannot acknowledge (the broker refused) stays in ``unacked``:
    kombu restores it after the visibility timeout and its next delivery is
    settled by the journal (a write) or runs again (a read).
    """
    handoff = handoff_of(request)
    if handoff is None or not handoff.ack_in_pool or request.is_eager or request.called_directly:
        return
    notes = existing_notes(request)
    if notes is not None and notes.acknowledged:
        return
    leases = tool.runtime.leases
    ack = leases.broker_ack(request.properties)
    if ack is None:
        return
    attempt_notes(request).acknowledged = True
    try:
        leases.acknowledge(ack)
    except redis.RedisError as exc:
        logger.warning("%s[%s] succeeded but its message was not acknowledged (%s); kombu "
                       "restores it after the visibility timeout", tool.name, request.id, exc)


def _message_headers(request: Context) -> Mapping[str, Any]:
    headers = getattr(request, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


def _ms_since(started: float) -> float:
    return (time.monotonic() - started) * 1000.0


#: How long a write whose outcome got no reply waits for the store to answer
#: again, to read whether the outcome was taken, before it fails closed (seconds).
LOST_REPLY_WAIT = 5.0


def outcome_landed(runtime: Any, attempt: Any, wait: float = LOST_REPLY_WAIT) -> bool:
    """Whether the store holds ``attempt``'s success although its script's
    reply was lost: the entry succeeded under this attempt's owner token.
    False when the store does not answer within ``wait`` seconds (the write
    then fails closed, as when the script never ran)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            entry = runtime.journal.read(attempt.ref)
        except StoreUnavailable:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)  # a Redis that restarts answers again within a second or two
            continue
        return bool(entry.get("state") == JournalState.SUCCEEDED
                    and entry.get("owner") == attempt.token)
