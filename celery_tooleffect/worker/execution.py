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
``LeaseLost`` (forget the delivery). The methods that decide an ending
*return* it and the caller raises it, so every ``raise`` of the protocol is
visible where the decision is taken.

Interactive runs (``apply()``, eager mode, a direct call) are journalled like
queued ones but never retried and never rejected: they raise, and settle
FAILURE.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import redis
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from kombu.exceptions import EncodeError
from kombu.serialization import dumps, loads

from ..effect import ToolEffect
from ..errors import (
    ApprovalRequired,
    AttemptInProgress,
    AuditPersistenceFailed,
    CallIdConflict,
    EffectRelabelRefused,
    IntentNotDurable,
    IntentNotRecorded,
    InterruptedWrite,
    LeaseLost,
    LeaseNotSecured,
    ReconcileFailed,
    ResultNotStorable,
    RetriesExhausted,
    StoreUnavailable,
    ToolEffectError,
)
from ..events import AuditEvent
from ..failures import FailureClass, is_no_side_effect
from ..identity import call_digest, conflict_text, publish_digest
from ..reconciliation import ReconcileStatus, Reconciliation
from ..states import ApprovalState, DeadLetterReason, JournalState
from ..store import states
from ..store.audit import describe_payload
from ..store.dead_letters import conflict_letter_id
from ..store.journal import Begin
from ..store.leases import Leases, LeaseVerdict
from ..store.runtime import ToolRuntime
from ..store.states import Ending, Verdict
from . import telemetry
from .attempt import Attempt, forged_headers, new_token
from .children import body_of
from .faults import crash_point
from .handoff import PendingLetter, handoff_of, noted, notes_of
from .heartbeat import Heartbeat, LeasePlan, plan_leases
from .letters import begin_dead_letter, build_letter, dead_lettered
from .results import check_storable, result_for_outcome, stored_by_the_outcome
from .retries import REQUESTED_EXHAUSTED_MARK, RetryPolicy, exhausted_text
from .signals import AUDITED_MARK
from .telemetry import tool_call_span

logger = logging.getLogger(__name__)


class Tool(Protocol):
    """What the protocol reads of a tool (``ToolTask`` provides it)."""

    name: str
    request: Context
    operation_deadline: float | None

    @property
    def tool_effect(self) -> ToolEffect: ...

    @property
    def retry_policy(self) -> RetryPolicy: ...

    @property
    def runtime(self) -> ToolRuntime: ...

    def signature_from_request(self, *args: Any, **kwargs: Any) -> Any: ...

    def run(self, *args: Any, **kwargs: Any) -> Any: ...

    def needs_approval(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool: ...


def tool_body(tool: Tool) -> Any:
    """The tool's own ``run``, without Celery's ``autoretry_for`` wrapper.

    ``@app.task(autoretry_for=...)`` wraps ``run`` to call ``self.retry()``
    (celery/app/autoretry.py) and keeps the original as ``_orig_run``; a
    tool's retries are decided by its
    :class:`~celery_tooleffect.worker.retries.RetryPolicy` instead, which
    reads the same options and spends the tool's one budget.
    """
    return tool.__dict__.get("_orig_run") or tool.run


def run_signature(tool: Tool) -> inspect.Signature:
    """The signature of the bound body (``bind=True`` tools do not count ``self``)."""
    # Kept in the instance's own __dict__: each registered tool is its own
    # instance, and a subclass tool must not find its parent's.
    signature = tool.__dict__.get("_signature")
    if signature is None:
        signature = inspect.signature(tool_body(tool))
        tool.__dict__["_signature"] = signature
    return signature


def run_tool(tool: Tool, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one call of ``tool``: its result, or the exception that ends it."""
    return Execution(tool, request, args, kwargs).run()


class Execution:
    """One attempt of one tool call, from the message check to its ending."""

    def __init__(
        self, tool: Tool, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.tool = tool
        self.request = request
        self.args = args
        self.kwargs = kwargs
        self.runtime = tool.runtime
        self.policy = tool.retry_policy
        #: What the worker's main process handed over with a queued call
        #: (worker/handoff.py); None for an interactive one.
        self.handoff = handoff_of(request)
        self.attempt = Attempt.of(
            vars(request),
            task_id=str(request.id),
            name=tool.name,
            effect=tool.tool_effect,
            delivery_info=request.delivery_info,
            default_queue=self.runtime.settings.default_queue,
            token=self.handoff.token if self.handoff is not None else new_token(),
            interactive=bool(request.is_eager or request.called_directly),
            retries=int(request.retries or 0),
        )
        #: The acknowledgement of this delivery that rides with its success
        #: (the main process asked for it: the broker is the store's Redis).
        self.ack = (self.runtime.leases.broker_ack(request.properties)
                    if self.handoff is not None and self.handoff.ack_in_pool
                    and not self.attempt.interactive else None)

    @property
    def label(self) -> str:
        return f"{self.tool.name}[{self.attempt.task_id}]"

    def run(self) -> Any:
        # One span per call when OpenTelemetry is installed (worker/telemetry.py).
        with tool_call_span(self.attempt, privacy=self.runtime.settings.privacy,
                            args=self.args, kwargs=self.kwargs,
                            classify=self.runtime.classifier.classify) as span:
            self._check_message()
            if not self.attempt.effect.is_write and not self._recorded_as_write():
                return span.succeeded(self._run_read_only())
            self._check_approval()
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
            raise self._after_failure(
                failed, FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
            ) from None
        if recorded is None or not recorded.is_write:
            return False
        logger.warning("%s is declared %s here but recorded %s by another release: handled "
                       "as %s", self.label, attempt.effect.value, recorded.value, recorded.value)
        self.attempt = replace(attempt, effect=recorded)
        return True

    def _check_approval(self) -> None:
        """Run a call that needs approval only when the store says it was approved.

        A queued call was let through by the worker's main process, which
        asked the store (worker/approvals.py) and said so in its hand-off; an
        interactive call cannot be parked, so it asks here and is refused
        unless approved.
        """
        if not self.tool.needs_approval(self.args, self.kwargs):
            return
        if self.handoff is not None and self.handoff.approved and not self.attempt.interactive:
            return
        state = self.runtime.approvals.state(self.attempt.run_id, self.attempt.task_id)
        if state is ApprovalState.APPROVED:
            return
        raise ApprovalRequired(
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
        raise self._dead_letter(
            DeadLetterReason.MALFORMED_MESSAGE, problem, FailureClass.CLIENT_ERROR,
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
            with body_of(attempt.task_id, attempt.run_id):
                result = tool_body(self.tool)(*self.args, **self.kwargs)
            crash_point("before_outcome", attempt.name)
        except Retry as requested:
            runtime.audit.record_step(_requested_retry_event(attempt, number, requested))
            raise
        except (Ignore, Reject):
            raise
        except Exception as exc:
            # The failed outcome is audited once, by the ending _after_failure
            # decides (a retry, a dead letter, or raised when interactive).
            failure_class = runtime.classifier.classify(exc)
            raise self._after_failure(exc, failure_class, number,
                                      duration_ms=_ms_since(started))
        # Celery's result rides in the audit append when the result backend is
        # the store's Redis (worker/results.py); a read's audit is fail-soft,
        # so when the append fails the result is left to Celery.
        try:
            stored = None if attempt.interactive else result_for_outcome(
                self.tool, self.request, result, runtime)
        except EncodeError as refused:
            raise self._result_not_storable(result, refused, number,
                                            duration_ms=_ms_since(started)) from None
        if not runtime.audit.record_step(
            attempt.context.event(
                "outcome", "succeeded", attempt=number, duration_ms=_ms_since(started),
                payload=self._payload(result=result),
            ),
            result=stored,
            ack=self.ack,
        ):
            telemetry.audit_write_failed("read", attempt.effect.value)
        else:
            self._acknowledged()
            if stored is not None:
                stored_by_the_outcome(self.request)
        return result

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
        notes_of(self.request).fencing_token = begin.fencing_token
        telemetry.step("intent recorded", **{"tooleffect.fencing_token": begin.fencing_token})
        crash_point("after_intent", attempt.name)
        number = begin.attempt
        started = time.monotonic()
        try:
            try:
                with self._heartbeat(plan), body_of(attempt.task_id, attempt.run_id):
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
            self._settle(
                JournalState.RETRY_SCHEDULED,
                _requested_retry_event(attempt, number, requested),
                cause=requested, ending=Ending.REQUESTED,
                fields=self._retried_with(requested),
            )
            raise
        except (Ignore, Reject):
            raise
        except Exception as exc:
            failure_class = runtime.classifier.classify(exc)
            raise self._after_failure(exc, failure_class, number, duration_ms=_ms_since(started))
        event = attempt.context.event(
            "outcome", "succeeded", attempt=number, duration_ms=_ms_since(started),
            payload=self._payload(result=result),
        )
        # Celery's result, stored by the outcome's script when the result
        # backend is the store's Redis (worker/results.py).
        try:
            stored = None if attempt.interactive else result_for_outcome(
                self.tool, self.request, result, runtime)
        except EncodeError as refused:
            if begin.intent_event is not None:
                runtime.audit.copy_to_global(begin.intent_event)
            raise self._result_not_storable(result, refused, number,
                                            duration_ms=_ms_since(started)) from None
        try:
            # SUCCEED_FROM includes 'absent': see its comment.
            moved = runtime.journal.transition(
                attempt.ref, new_state=JournalState.SUCCEEDED,
                allowed=states.SUCCEED_FROM, token=attempt.token, event=event,
                earlier_copy=begin.intent_event, result=stored, ack=self.ack,
                fields=self._kept(result) if attempt.interactive else None,
            )
        except StoreUnavailable as store_down:
            telemetry.audit_write_failed("write", attempt.effect.value)
            failed = AuditPersistenceFailed(
                f"{self.label} ran, but its outcome could not be recorded: {store_down}",
                body_completed=True,
            )
            if attempt.interactive:
                raise failed from store_down
            raise self._dead_letter(
                DeadLetterReason.NOT_RETRYABLE, failed, FailureClass.UNKNOWN,
                owned=True, attempts=number, body_completed=True,
                outcome_event=attempt.context.event(
                    "outcome", "audit_failed", attempt=number, exception=failed,
                    failure_class=FailureClass.UNKNOWN.value,
                ),
            )
        if not moved:
            # Another delivery owns the entry now; the outcome was stored as a
            # late_outcome, and the dead letter (if any) gets a copy of it.
            runtime.dead_letters.record_late_outcome(attempt.task_id, event)
            if not attempt.interactive:
                raise LeaseLost(f"{self.label} finished after losing its lease")
        else:
            self._acknowledged()
            if stored is not None:
                stored_by_the_outcome(self.request)
        return result

    def _result_not_storable(
        self, result: Any, refused: EncodeError, number: int, *,
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
        serializer = getattr(getattr(self.tool, "backend", None), "serializer", None) or "json"
        failed = _caused(ResultNotStorable(
            f"{self.label} {ran}, but its result cannot be stored: the result serializer "
            f"{serializer!r} cannot encode a {type_name}: {type(refused).__name__}: {refused}. "
            f"The tool must return a value {serializer!r} can encode",
            result_type=type_name,
        ), refused)
        return self._dead_letter(
            DeadLetterReason.NOT_RETRYABLE, failed, FailureClass.UNKNOWN,
            owned=owned, attempts=number, body_completed=self.attempt.effect.is_write,
            error=failed,
            outcome_event=self.attempt.context.event(
                "outcome", "result_not_stored", attempt=number,
                duration_ms=duration_ms, exception=failed,
                failure_class=FailureClass.UNKNOWN.value,
                payload=self._payload(error=failed),
            ),
        )

    def _acknowledged(self) -> None:
        """The script that recorded the success acknowledged the message too."""
        if self.ack is not None:
            notes_of(self.request).acknowledged = True

    # -- before the body -------------------------------------------------------

    def _lease_plan(self) -> LeasePlan:
        """The write's leases (:func:`plan_leases`); with a deadline, the broker
        lease secured until it before anything is recorded: here, or by the
        intent's own script when the broker is the store's Redis (``_begin``)."""
        attempt, runtime = self.attempt, self.runtime
        plan = plan_leases(runtime.settings, self.tool.operation_deadline)
        deadline_end = plan.deadline_end
        if deadline_end is None or attempt.interactive:
            return plan
        lease = runtime.leases.broker_lease(self.request.properties)
        if lease is None:
            return plan
        if runtime.leases.shares_the_store:
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
        return self._after_failure(
            not_secured, FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
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
            "intent", "started", payload={**self._payload(), **lease_note},
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
                    call_digest=self._digest(),
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
            raise self._after_failure(
                IntentNotDurable(f"{self.label} not run: {not_durable}"),
                FailureClass.CONNECTION, not_durable.attempt, body_started=False,
                intent_recorded=True,
            )
        except StoreUnavailable as store_down:
            failed = IntentNotRecorded(
                f"{self.label} not run: its intent could not be recorded: {store_down}"
            )
            if attempt.interactive:
                raise failed from store_down
            if _already_ended(runtime, attempt) or _already_dead_lettered(runtime, attempt):
                logger.warning("%s delivered again after it ended; acknowledged without "
                               "running (not audited: %s)", self.label, store_down)
                raise Ignore() from None
            raise self._after_failure(
                failed, FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
            )

        verdict = begin.verdict
        self._handle_as(begin.effect)
        if verdict is Verdict.CONFLICT:
            raise self._conflict(begin)
        if verdict is Verdict.DONE and attempt.interactive and begin.kept_content_type:
            return KeptResult(self._unkept(begin))
        if verdict is Verdict.STARTED:
            if with_intent is not None:
                telemetry.step("lease secured", **{"tooleffect.lease_until": deadline_end})
            return begin
        if verdict is Verdict.LEASE_LOST:
            raise self._lease_refused(LeaseVerdict.LOST, deadline_end)
        if verdict is Verdict.LEASE_BUSY:
            raise self._lease_refused(LeaseVerdict.BUSY, deadline_end)
        if verdict in (Verdict.DONE, Verdict.DEAD_LETTERED, Verdict.NOT_RUN):
            raise Ignore()
        if verdict is Verdict.OWNED:
            raise self._come_back_later(begin)
        if verdict is Verdict.DEAD_LETTERING:
            raise self._finish_dead_letter(begin)
        if verdict is Verdict.INTERRUPTED:
            return self._reconcile(begin, plan)
        # Verdict.EXHAUSTED: earlier attempts spent the retry budget (the
        # journal counted how they ended).
        raise self._dead_letter(
            DeadLetterReason.RETRIES_EXHAUSTED,
            RetriesExhausted(exhausted_text(
                self.tool.name, attempt.task_id, attempts=begin.attempt,
                budget=self.policy.budget, endings=begin.endings or {},
            )),
            FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
        )

    def _reconcile(self, begin: Begin, plan: LeasePlan) -> Begin | Reconciliation | KeptResult:
        """An interrupted NON_IDEMPOTENT_WRITE: ask the tool's ``reconcile``
        whether its write happened, and end as it says.

        Applied: the journal settles SUCCEEDED with the tool's result, returned
        here (the body does not run). Not applied: a new attempt begins (the
        body runs, within the retry budget). Unknown, an error, a timeout, or
        no ``reconcile``: a dead letter INTERRUPTED_WRITE, as without it.
        """
        attempt, runtime = self.attempt, self.runtime
        if begin.detail == "store_rolled_back" and _already_dead_lettered(runtime, attempt):
            # The rollback lost its journal, not its dead letter (kept by the
            # broker's Redis, or stored after the store came back): it ended.
            logger.warning("%s delivered again after a rollback of the store; it is a dead "
                           "letter already: acknowledged without running", self.label)
            raise Ignore()
        check = reconciler(self.tool)
        reason, interrupted = interruption(self.label, begin.detail)
        if check is None:
            raise self._dead_letter(
                reason,
                InterruptedWrite(f"{interrupted}; a non-idempotent write is never run twice"),
                FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
            )
        started = time.monotonic()
        answer, problem = ask(check, self.tool, self.request, self.args, self.kwargs,
                              timeout=runtime.settings.reconcile_timeout)
        status = ReconcileStatus.FAILED if answer is None else answer.status
        telemetry.step("reconciled", **{"tooleffect.reconcile.status": status.value})
        evidence = answer.evidence if answer is not None else f"{type(problem).__name__}"
        failure_class = None if problem is None else runtime.classifier.classify(problem)
        runtime.audit.record_step(attempt.context.event(
            "reconcile", status.value, attempt=begin.attempt, duration_ms=_ms_since(started),
            exception=problem, failure_class=failure_class,
            payload=describe_payload(runtime.settings.privacy, evidence=evidence),
        ))
        if answer is not None and answer.status is ReconcileStatus.APPLIED:
            return self._settle_reconciled(answer, begin)
        if answer is not None and answer.status is ReconcileStatus.NOT_APPLIED:
            return self._begin(plan, resume=True)
        why = (f"its reconcile answered unknown ({answer.evidence or 'no evidence'})"
               if answer is not None
               else f"its reconcile failed: {type(problem).__name__}: {problem}")
        raise self._dead_letter(
            reason,
            InterruptedWrite(f"{interrupted}, and {why}; a non-idempotent write is "
                             "never run twice without knowing"),
            FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
        )

    def _settle_reconciled(self, answer: Reconciliation, begin: Begin) -> Reconciliation:
        """The interrupted write happened: record its success with the tool's result
        (a result Celery cannot store ends it as the body's would)."""
        attempt = self.attempt
        try:
            check_storable(self.tool, self.request, answer.result)
        except EncodeError as refused:
            raise self._result_not_storable(
                answer.result, refused, begin.attempt, owned=False,
                ran="was reconciled as applied") from None
        event = attempt.context.event(
            "outcome", "succeeded", attempt=begin.attempt, reconciled="1",
            payload=self._payload(result=answer.result),
        )
        try:
            moved = self.runtime.journal.transition(
                attempt.ref, new_state=JournalState.SUCCEEDED,
                allowed=states.RECONCILED_FROM, token="", event=event, ack=self.ack,
            )
        except StoreUnavailable as store_down:
            not_recorded = IntentNotRecorded(
                f"{self.label}: reconciled as applied, but that could not be recorded: "
                f"{store_down}"
            )
            if attempt.interactive:
                raise not_recorded from store_down
            # Nothing ran: the next delivery reconciles again.
            raise self._after_failure(
                not_recorded, FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
            )
        if not moved:
            # Another delivery settled or resumed it meanwhile: that one ends it.
            raise LeaseLost(f"{self.label}: settled by another delivery while reconciling")
        self._acknowledged()
        return answer

    # -- call identity (docs/identity.md) ----------------------------------------

    def _digest(self) -> str:
        """The digest of this call's arguments (:mod:`celery_tooleffect.identity`):
        of the decoded ones for a queued call; an interactive call's go through
        the app's serializer first, which raises what Celery's publish would
        for arguments it cannot encode, before anything runs."""
        digest = self.__dict__.get("_call_digest")
        if digest is None:
            if self.attempt.interactive:
                digest = publish_digest(self.args, self.kwargs, self._serializer)
            else:
                digest = call_digest(self.args, self.kwargs)
            self.__dict__["_call_digest"] = digest
        return digest

    @property
    def _serializer(self) -> str:
        return str(getattr(self.tool, "serializer", None) or "json")

    def _handle_as(self, recorded: str) -> None:
        """Handle this call under the effect the journal decided (the stricter
        of the declared one and one recorded by another release)."""
        if recorded and recorded != self.attempt.effect.value:
            effect = ToolEffect.coerce(recorded)
            logger.warning("%s is declared %s here but recorded %s by another release: "
                           "handled as %s", self.label, self.attempt.effect.value,
                           effect.value, effect.value)
            self.attempt = replace(self.attempt, effect=effect)

    def _conflict(self, begin: Begin) -> BaseException:
        """The task id is another call's: refused, changing nothing of that call.

        Interactive: raised. Queued: a dead letter ``call_id_conflict`` under an
        id of its own, the journal untouched, and no result stored (the task
        id's result is the first call's)."""
        attempt = self.attempt
        conflict = "tool" if begin.detail == "tool" else "arguments"
        refused = CallIdConflict(
            conflict_text(attempt.task_id, attempt.name, begin.recorded_tool, conflict),
            task_id=attempt.task_id, tool=attempt.name, recorded_tool=begin.recorded_tool,
            conflict=conflict,
        )
        if attempt.interactive:
            return refused
        return self._dead_letter(
            DeadLetterReason.CALL_ID_CONFLICT, refused, FailureClass.CLIENT_ERROR,
            owned=False, attempts=0, journalled=False,
            letter_id=conflict_letter_id(attempt.task_id, self._digest()), keep_result=True,
        )

    def _kept(self, result: Any) -> dict[str, str] | None:
        """An interactive call's result, kept in its journal entry: a tool called
        in a tool's body answers with it when its parent runs again."""
        serializer = getattr(getattr(self.tool, "app", None), "conf", {}).get(
            "result_serializer") or "json"
        try:
            content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
                result, serializer=serializer)
        except Exception as exc:
            logger.info("%s: result not kept (%s): a call again answers without it",
                        self.label, exc)
            return None
        text = data.decode("latin-1") if isinstance(data, bytes) else data
        return {"result": text, "result_type": f"{content_type} {encoding}"}

    def _unkept(self, begin: Begin) -> Any:
        content_type, _, encoding = begin.kept_content_type.partition(" ")
        # Kept as text (_kept): a binary encoding went through latin-1.
        kept = begin.kept_result.decode("utf-8")
        data: bytes | str = kept if encoding == "utf-8" else kept.encode("latin-1")
        return loads(  # type: ignore[no-untyped-call]
            data, content_type, encoding, accept={content_type}, force=True)

    def _retried_with(self, requested: Retry) -> dict[str, str] | None:
        """The new digest of a retry the tool asked for with other arguments
        (``self.retry(args=...)``): its own decision, so it is the same call."""
        sig = getattr(requested, "sig", None)
        if sig is None:
            return None
        args, kwargs = tuple(sig.args or ()), dict(sig.kwargs or {})
        if args == tuple(self.args) and kwargs == self.kwargs:
            return None
        return {"call_digest": publish_digest(args, kwargs, self._serializer)}

    # -- endings: each returns the exception that ends the call ----------------

    def _after_failure(
        self,
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
        attempt = self.attempt
        journalled = attempt.effect.is_write and (body_started or intent_recorded)
        # A read keeps no journal: its failed body is audited here, once (a
        # dead letter's own step records it when that is the ending).
        audit_read = not attempt.effect.is_write and body_started
        outcome = attempt.context.event(
            "outcome", "failed", attempt=number, duration_ms=duration_ms, exception=exc,
            failure_class=failure_class.value, payload=self._payload(error=exc),
        )
        if attempt.interactive:
            if audit_read:
                self.runtime.audit.record_step(outcome)
            if journalled:
                # A non-idempotent write that failed may have written: it is
                # not run again under its id (a tool called in a tool's body,
                # whose parent runs again) unless it says it wrote nothing.
                self._settle(JournalState.FAILED, outcome, cause=exc, fields={
                    "no_side_effect": "1" if is_no_side_effect(exc) else "0"})
            exc.__dict__.setdefault("failure_class", failure_class.value)
            setattr(exc, AUDITED_MARK, True)
            return exc
        requested_limit = exc.__dict__.get(REQUESTED_EXHAUSTED_MARK)
        if requested_limit is not None:
            # self.retry() found the budget spent and raised the tool's error.
            spent = RetriesExhausted(
                f"{self.label} asked for a retry (self.retry()) after "
                f"{attempt.retries} retries; its retry budget of {requested_limit} is spent. "
                f"Last error: {type(exc).__name__}: {exc}"
            )
            # Celery's result is what its retry() raised, as in plain Celery.
            return self._dead_letter(
                DeadLetterReason.RETRIES_EXHAUSTED, spent, failure_class,
                owned=journalled, attempts=number, outcome_event=outcome, error=_shown(exc),
            )
        decision = self.policy.after_failure(
            exc, failure_class, retries=attempt.retries, attempt=number,
            body_started=body_started,
        )
        if decision.retry:
            if audit_read:
                self.runtime.audit.record_step(outcome)
            if journalled:
                retrying = outcome.amended(status="retrying", countdown=decision.countdown)
                try:
                    self._settle(JournalState.RETRY_SCHEDULED, retrying, cause=exc,
                                 ending=Ending.FAILED)
                except AuditPersistenceFailed as lost:
                    return self._dead_letter(
                        DeadLetterReason.NOT_RETRYABLE, lost, FailureClass.UNKNOWN,
                        owned=True, attempts=number,
                    )
            return self._publish_retry(exc, decision.countdown)
        reason = (DeadLetterReason.RETRIES_EXHAUSTED if decision.exhausted
                  else DeadLetterReason.NOT_RETRYABLE)
        return self._dead_letter(
            reason, exc, failure_class, owned=journalled, attempts=number,
            outcome_event=outcome, error=_shown(exc),
        )

    def _settle(
        self, state: JournalState, event: AuditEvent, *,
        cause: Exception, ending: Ending | None = None,
        fields: Mapping[str, str] | None = None,
    ) -> None:
        """Record a failed attempt's outcome; fail closed when it cannot be stored."""
        attempt = self.attempt
        try:
            moved = self.runtime.journal.transition(
                attempt.ref, new_state=state, allowed=states.SETTLE_FROM,
                token=attempt.token, event=event, ending=ending, fields=fields,
            )
        except StoreUnavailable as store_down:
            raise AuditPersistenceFailed(
                f"{self.label} failed ({type(cause).__name__}) and its "
                f"outcome could not be recorded: {store_down}"
            ) from cause
        if not moved and not attempt.interactive:
            raise LeaseLost(f"{self.label} failed after losing its lease")

    def _publish_retry(self, exc: Exception, countdown: float) -> BaseException:
        """Publish the retry: Celery's ``Retry``, or, when the publish fails, a
        ``Reject`` that keeps the message (never a deleting one)."""
        request = self.request
        signature = self.tool.signature_from_request(
            request, countdown=countdown, retries=int(request.retries or 0) + 1
        )
        try:
            signature.apply_async()
        except Exception as publish_failed:
            logger.error("retry of %s not published, requeueing: %s", self.label, publish_failed)
            return _caused(Reject(publish_failed, requeue=True), exc)
        telemetry.step("retry scheduled", **{"tooleffect.countdown": countdown})
        retry: BaseException = Retry(exc=exc, when=countdown, sig=signature)
        return retry

    def _come_back_later(self, begin: Begin) -> BaseException:
        """A live owner runs this task: republish for when its lease ends."""
        attempt, settings = self.attempt, self.runtime.settings
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
            return AttemptInProgress(f"{self.label} is running elsewhere for {wait:.0f}s more")
        signature = self.tool.signature_from_request(self.request, countdown=wait)
        try:
            signature.apply_async()
        except Exception as publish_failed:
            kept: BaseException = Reject(publish_failed, requeue=True)
            return kept
        telemetry.step("deferred", **{"tooleffect.countdown": wait})
        self.runtime.audit.record_step(
            attempt.context.event("deferred", "owned_elsewhere", countdown=f"{wait:.1f}")
        )
        acknowledged: BaseException = Ignore()
        return acknowledged

    def _finish_dead_letter(self, begin: Begin) -> BaseException:
        """A dead letter was begun but not finished: finish it with its recorded reason."""
        journal = self.runtime.journal.read(self.attempt.ref)
        try:
            reason = DeadLetterReason.coerce(journal.get("reason", ""))
        except ValueError:
            reason = DeadLetterReason.NOT_RETRYABLE
        failure_class = FailureClass.coerce(journal.get("failure_class") or "unknown")
        pending = AuditPersistenceFailed(
            f"{self.label}: finishing a dead letter begun earlier "
            f"({journal.get('exception_type', '')})",
            body_completed=journal.get("body_completed") == "1",
        )
        return self._dead_letter(
            reason, pending, failure_class, owned=False, attempts=begin.attempt,
            body_completed=pending.body_completed, allowed=states.FINISH_DEAD_LETTER_FROM,
        )

    def _dead_letter(
        self,
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
        attempt = self.attempt
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
        begin_dead_letter(self.runtime, attempt, letter, outcome_event=event, owned=owned,
                          allowed=allowed, journalled=journalled)
        pending = PendingLetter(replace(letter, message=None), journalled, keep_result)
        telemetry.step("dead-lettered", **{"tooleffect.dead_letter.reason": reason.value})
        return _caused(dead_lettered(letter, exc, pending_letter=pending, error=error), exc)

    def _payload(self, **values: Any) -> dict[str, str]:
        """The call's arguments (and ``values``) as the privacy setting allows."""
        return describe_payload(
            self.runtime.settings.privacy, args=self.args, kwargs=self.kwargs, **values
        )


@dataclass(frozen=True)
class KeptResult:
    """What ``_begin`` answers for an interactive call that ended before (a tool
    called in a tool's body whose parent runs again): its kept result."""

    value: Any


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
    notes = noted(request)
    if notes is not None and notes.acknowledged:
        return
    leases = tool.runtime.leases
    ack = leases.broker_ack(request.properties)
    if ack is None:
        return
    notes_of(request).acknowledged = True
    try:
        leases.acknowledge(ack)
    except redis.RedisError as exc:
        logger.warning("%s[%s] succeeded but its message was not acknowledged (%s); kombu "
                       "restores it after the visibility timeout", tool.name, request.id, exc)


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


def reconciler(tool: Any) -> Callable[..., Any] | None:
    """The tool's ``reconcile``, if it declares one
    (see :mod:`celery_tooleffect.reconciliation`)."""
    check = getattr(tool, "reconcile", None)
    return check if callable(check) else None


def ask(
    check: Callable[..., Any], tool: Any, request: Context, args: tuple[Any, ...],
    kwargs: dict[str, Any], *, timeout: float,
) -> tuple[Reconciliation | None, BaseException | None]:
    """Call ``check(*args, **kwargs)`` for at most ``timeout`` seconds: its
    answer, or None and why there is none (it raised, timed out, or answered
    something that is not a :class:`Reconciliation`).

    It runs on a thread of its own, which sees the call's request (Celery
    keeps ``task.request`` per thread), so ``self.idempotency_key`` works in
    it. A call that outlives its timeout is left to finish on its daemon
    thread; its answer is ignored.
    """
    answers: list[Any] = []

    def call() -> None:
        tool.request_stack.push(request)
        try:
            answers.append(check(*args, **kwargs))
        except BaseException as exc:
            answers.append(exc)
        finally:
            tool.request_stack.pop()

    thread = threading.Thread(target=call, name="tooleffect-reconcile", daemon=True)
    thread.start()
    thread.join(timeout)
    if not answers:
        return None, ReconcileFailed(f"reconcile did not answer within {timeout:g}s")
    answer = answers[0]
    if isinstance(answer, Reconciliation):
        return answer, None
    if isinstance(answer, BaseException):
        return None, answer
    return None, ReconcileFailed(
        f"reconcile answered {type(answer).__name__}, not a Reconciliation "
        "(Reconciliation.applied / not_applied / unknown)"
    )


def _requested_retry_event(attempt: Attempt, number: int, requested: Retry) -> AuditEvent:
    """The audit event of a retry the tool asked for (``self.retry()``)."""
    cause = requested.exc if isinstance(requested.exc, BaseException) else None
    countdown = requested.when if isinstance(requested.when, (int, float)) else None
    return attempt.context.event("outcome", "retrying", attempt=number, exception=cause,
                                 requested="1", countdown=countdown)


def _shown(exc: BaseException) -> BaseException | None:
    """What Celery's result shows for a dead letter caused by ``exc``: ``exc``
    when the tool's body raised it; None (the ``DeadLettered`` itself) when it
    is the package's own (a store that did not answer, a lease not secured)."""
    return None if isinstance(exc, ToolEffectError) else exc


def _caused(ending: BaseException, cause: BaseException) -> BaseException:
    """``ending`` as ``raise ending from cause`` leaves it."""
    ending.__cause__ = cause
    ending.__suppress_context__ = True
    return ending


def _type_name(value: Any) -> str:
    """The name of ``value``'s type, with its module unless a builtin's."""
    kind = type(value)
    return (kind.__qualname__ if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}")


def _message_headers(request: Context) -> Mapping[str, Any]:
    headers = getattr(request, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


def _already_ended(runtime: ToolRuntime, attempt: Attempt) -> bool:
    """Whether the journal, read when it cannot be written, says the task ended.

    A store that refuses writes (out of memory, read-only replica, ACL) still
    answers reads: a delivery of a task that succeeded or was dead-lettered is
    then acknowledged without running, as it is when the store is healthy,
    instead of being retried until its budget is spent and dead-lettered.
    """
    try:
        state = runtime.journal.read(attempt.ref).get("state")
    except StoreUnavailable:
        return False
    return state in states.ENDED


def _already_dead_lettered(runtime: ToolRuntime, attempt: Attempt) -> bool:
    try:
        return runtime.dead_letters.exists(attempt.task_id)
    except StoreUnavailable:
        return False


def _ms_since(started: float) -> float:
    return (time.monotonic() - started) * 1000.0
