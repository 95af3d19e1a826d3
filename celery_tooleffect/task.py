"""``ToolTask``: the Celery task base class that makes a task a safe agent tool.

It orchestrates; the Redis details live in the journal, audit and dead-letter
modules. For a write, in this order: record the intent (or do not run), run
the body, record the outcome (or fail closed). For a failure: classify it with
the original exception, then retry, dead-letter or (interactive runs) raise.

Interactive runs (``apply()``, eager mode, a direct call) are journalled like
queued ones but never retried and never rejected: they raise, and settle
FAILURE.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.app.annotations import resolve_all as resolve_all_annotations
from celery.app.task import Context
from celery.exceptions import Ignore, ImproperlyConfigured, Reject, Retry

from .attempt import (
    FORGED_FIELD,
    TOKEN_FIELD,
    Attempt,
    forged_headers,
    new_token,
    queue_name,
    resolve_run_id,
    without_internal_fields,
)
from .audit import describe_payload
from .consumer import install_consumer_step
from .dead_letters import DeadLetterReason
from .effect import ToolEffect, ToolEffectResolver
from .errors import (
    AuditPersistenceFailed,
    EffectRelabelRefused,
    IntentNotRecorded,
    InterruptedWrite,
    LeaseLost,
    LeaseNotSecured,
    RetriesExhausted,
    StoreUnavailable,
)
from .failures import FailureClass
from .journal import Begin, Ending, JournalState, Verdict
from .leases import Heartbeat, LeasePlan, LeaseVerdict, heartbeat_interval
from .retries import (
    REQUESTED_EXHAUSTED_MARK,
    RetryPolicy,
    exhausted_text,
    refuse_autoretry,
    refuse_unbounded_retries,
)
from .runtime import ToolRuntime, build_letter, runtime_for
from .settings import refuse_unknown_settings
from .signals import AUDITED_MARK, connect_signals
from .startup import install_startup_checks

logger = logging.getLogger(__name__)

#: Options the guarantees depend on: no annotation or call option may set them.
PROTECTED_OPTIONS = frozenset(
    {
        "effect",
        "get_effect",
        "operation_deadline",
        "acks_late",
        "acks_on_failure_or_timeout",
        "acks_on_failure",
        "acks_on_timeout",
        "reject_on_worker_lost",
        "retry_on_worker_lost",
        "Request",
        "Strategy",
        "__call__",
        "run",
    }
)


class AttemptInProgress(Exception):
    """An interactive call found the same task id running elsewhere."""

    failure_class = FailureClass.CONNECTION.value


class ToolTask(Task):  # type: ignore[misc]
    """Base class of agent tools. See the package README for the guarantees."""

    #: The tool's side effect; a tool that declares nothing is READ_ONLY.
    effect: ClassVar[ToolEffect | str | None] = None
    #: Seconds a write may take; its lease is secured for this long.
    operation_deadline: ClassVar[float | None] = None
    #: Whether the tool reaches outside the system (MCP ``openWorldHint``).
    open_world: ClassVar[bool] = True

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    retry_on_worker_lost = False
    acks_on_failure_or_timeout = False
    Request = "celery_tooleffect.request:ToolRequest"
    Strategy = "celery_tooleffect.strategy:tool_strategy"

    # -- binding and declaration -------------------------------------------

    @classmethod
    def bind(cls, app: Any) -> Any:
        bound = super().bind(app)
        declared = (
            ToolEffect.coerce(cls.effect) if cls.effect is not None else ToolEffect.READ_ONLY
        )
        if cls.operation_deadline is not None and float(cls.operation_deadline) <= 0:
            raise ImproperlyConfigured(f"{cls.name}: operation_deadline must be positive")
        if (
            declared.is_write
            and cls.operation_deadline is not None
            and cls.time_limit is not None
            and float(cls.time_limit) > float(cls.operation_deadline)
        ):
            raise EffectRelabelRefused(
                f"{cls.name}: time_limit {cls.time_limit}s is longer than its "
                f"operation_deadline {cls.operation_deadline}s"
            )
        refuse_unknown_settings(app.conf)
        if "get_effect" not in _overridden(cls):
            refuse_autoretry(cls, declared)
        refuse_unbounded_retries(cls)
        connect_signals()
        install_consumer_step(app)
        install_startup_checks(app)
        return bound

    @classmethod
    def annotate(cls) -> None:
        for annotation in resolve_all_annotations(cls.app.annotations, cls):
            refused = sorted(set(annotation) & PROTECTED_OPTIONS)
            if refused:
                raise EffectRelabelRefused(
                    f"task_annotations may not set {', '.join(refused)} on tool "
                    f"{cls.name}: its effect and delivery guarantees are declared in code"
                )
        super().annotate()

    def get_effect(self) -> ToolEffect:
        """The declared effect (override to compute it in code)."""
        return ToolEffect.READ_ONLY if self.effect is None else ToolEffect.coerce(self.effect)

    # What a tool resolves once is kept in the instance's own __dict__: each
    # registered tool is its own instance, so nothing one tool resolved is
    # found by another through the class hierarchy (a subclass tool would
    # otherwise read its parent's).

    @property
    def tool_effect(self) -> ToolEffect:
        """The effect this tool declares, resolved once."""
        resolved = self.__dict__.get("_tool_effect")
        if resolved is None:
            resolved = ToolEffectResolver.effect_for_tool(self)
            refuse_autoretry(self, resolved)
            self.__dict__["_tool_effect"] = resolved
        return resolved

    @property
    def retry_policy(self) -> RetryPolicy:
        """This tool's retry budget and backoff (see :mod:`celery_tooleffect.retries`)."""
        policy = self.__dict__.get("_retry_policy")
        if policy is None:
            policy = RetryPolicy.of(self, self.runtime.settings, self.tool_effect)
            self.__dict__["_retry_policy"] = policy
        return policy

    @property
    def max_retries(self) -> int:
        """Celery's retry limit: the tool's retry budget.

        A tool that declares ``max_retries`` overrides this; one that does not
        gets the app's ``tooleffect_max_retries``, so that ``self.retry()``
        and the package's own retries spend one budget.
        """
        return self.retry_policy.budget

    def mcp_annotations(self) -> dict[str, bool]:
        """MCP tool annotations of this tool."""
        return self.tool_effect.mcp_annotations(open_world=self.open_world)

    @property
    def runtime(self) -> ToolRuntime:
        return runtime_for(self.app)

    # -- calling -------------------------------------------------------------

    def signature_from_request(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's, without the fields the worker added to the request for its pool
        (every republish of a task from its own request goes through here)."""
        return without_internal_fields(super().signature_from_request(*args, **kwargs))

    def retry(
        self, args: Any = None, kwargs: Any = None, exc: BaseException | None = None,
        throw: bool = True, eta: Any = None, countdown: float | None = None,
        max_retries: int | None = None, **options: Any,
    ) -> Any:
        """Celery's retry (the tool's own decision, honoured for every effect), except:

        - it spends the tool's one retry budget: ``max_retries`` may lower it for
          this call, never raise it;
        - once the budget is spent, what Celery raises (``exc``, or
          ``MaxRetriesExceededError``) ends the task as a dead letter
          RETRIES_EXHAUSTED that says requested retries spent it;
        - a retry that cannot be published keeps its message (requeued)
          instead of deleting it, as Celery's ``Reject`` would.
        """
        budget = self.retry_policy.budget
        limit = budget if max_retries is None else min(int(max_retries), budget)
        request = self.request
        spent = not request.called_directly and int(request.retries or 0) + 1 > limit
        try:
            return super().retry(
                args, kwargs, exc, throw, eta, countdown,
                max_retries=None if max_retries is None else limit, **options,
            )
        except Reject as rejected:
            if rejected.requeue:
                raise
            raise Reject(rejected.reason, requeue=True) from rejected
        except Retry:
            raise
        except BaseException as raised:
            if spent:
                raised.__dict__[REQUESTED_EXHAUSTED_MARK] = limit
            raise

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        _refuse_relabel(self.name, options)
        return super().apply_async(args, kwargs, **options)

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        _refuse_relabel(self.name, options)
        return super().apply(args, kwargs, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.id is not None:
            return self._run_tool(request, args, kwargs)
        # A direct call: give it a task id so that a write is journalled
        # exactly like a queued one; its run id is that task id.
        task_id = uuid.uuid4().hex
        self.push_request(
            args=args, kwargs=kwargs, id=task_id, root_id=task_id, is_eager=True,
            called_directly=True,
        )
        try:
            return self._run_tool(self.request, args, kwargs)
        finally:
            self.pop_request()

    # -- one attempt ---------------------------------------------------------

    def _attempt(self, request: Context) -> Attempt:
        fields = vars(request)
        task_id = str(request.id)
        return Attempt(
            task_id=task_id,
            run_id=resolve_run_id(fields, task_id),
            name=self.name,
            effect=self.tool_effect,
            queue=queue_name(request.delivery_info, self.runtime.settings.default_queue),
            token=str(fields.get(TOKEN_FIELD) or new_token()),
            redelivered=bool((request.delivery_info or {}).get("redelivered")),
            interactive=bool(request.is_eager or request.called_directly),
            retries=int(request.retries or 0),
        )

    def _run_tool(self, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        attempt = self._attempt(request)
        self._check_message(attempt, request, args, kwargs)
        if not attempt.effect.is_write:
            return self._run_read_only(attempt, request, args, kwargs)
        return self._run_write(attempt, request, args, kwargs)

    def _check_message(
        self, attempt: Attempt, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Refuse forged headers and arguments the tool cannot take, before anything runs."""
        # Queued messages were checked by the worker's main process; an
        # interactive call carries its headers on the request.
        checked = getattr(request, FORGED_FIELD, None)
        forged = list(checked) if checked is not None else forged_headers(
            _message_headers(request)
        )
        problem: BaseException | None = None
        if forged:
            problem = EffectRelabelRefused(
                f"message sets reserved header(s) {', '.join(forged)}; "
                "a producer may set only tooleffect_run_id"
            )
        else:
            try:
                self._run_signature().bind(*args, **kwargs)
            except TypeError as exc:
                problem = TypeError(f"{self.name}: invalid arguments: {exc}")
        if problem is None:
            return
        if attempt.interactive:
            raise problem
        self._dead_letter(
            attempt, request, DeadLetterReason.MALFORMED_MESSAGE, problem,
            FailureClass.CLIENT_ERROR, owned=False, attempts=0, journalled=False,
        )

    def _run_signature(self) -> inspect.Signature:
        # Of the bound ``run``, so that ``bind=True`` tools do not count ``self``.
        signature = self.__dict__.get("_signature")
        if signature is None:
            signature = inspect.signature(self._body())
            self.__dict__["_signature"] = signature
        return signature

    def _body(self) -> Any:
        """The tool's own ``run``, without Celery's ``autoretry_for`` wrapper.

        ``@app.task(autoretry_for=...)`` wraps ``run`` to call ``self.retry()``
        (celery/app/autoretry.py); a tool's retries are decided by its
        :class:`~celery_tooleffect.retries.RetryPolicy` instead, which reads
        the same options and spends the tool's one budget.
        """
        return self.__dict__.get("_orig_run") or self.run

    def _run_read_only(
        self, attempt: Attempt, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        runtime = self.runtime
        privacy = runtime.settings.privacy
        number = attempt.retries + 1
        started = time.monotonic()
        try:
            result = self._body()(*args, **kwargs)
        except Retry as requested:
            runtime.audit.record_step(_requested_retry_event(attempt, number, requested))
            raise
        except (Ignore, Reject):
            raise
        except Exception as exc:
            failure_class = runtime.classifier.classify(exc)
            runtime.audit.record_step(
                attempt.context.event(
                    "outcome", "failed", attempt=number, duration_ms=_ms_since(started),
                    exception=exc, failure_class=failure_class.value,
                    payload=_payload(privacy, args=args, kwargs=kwargs, error=exc),
                )
            )
            self._after_failure(attempt, request, exc, failure_class, number)
        runtime.audit.record_step(
            attempt.context.event(
                "outcome", "succeeded", attempt=number, duration_ms=_ms_since(started),
                payload=_payload(privacy, args=args, kwargs=kwargs, result=result),
            )
        )
        return result

    def _run_write(
        self, attempt: Attempt, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        runtime = self.runtime
        privacy = runtime.settings.privacy
        plan = self._lease_plan(attempt, request)
        begin = self._begin(attempt, request, args, kwargs, plan)
        number = begin.attempt
        started = time.monotonic()
        try:
            try:
                with self._heartbeat(attempt, plan):
                    result = self._body()(*args, **kwargs)
            except BaseException:
                # The intent's global-stream copy normally rides with the
                # outcome (one round trip less); on a failure it goes alone.
                if begin.intent_event is not None:
                    runtime.audit.copy_to_global(begin.intent_event)
                raise
        except Retry as requested:
            # The tool called self.retry(): the attempt ends here, by choice.
            self._settle(
                attempt, JournalState.RETRY_SCHEDULED,
                _requested_retry_event(attempt, number, requested),
                cause=requested, ending=Ending.REQUESTED,
            )
            raise
        except (Ignore, Reject):
            raise
        except Exception as exc:
            failure_class = runtime.classifier.classify(exc)
            self._after_failure(attempt, request, exc, failure_class, number,
                                duration_ms=_ms_since(started))
        event = attempt.context.event(
            "outcome", "succeeded", attempt=number, duration_ms=_ms_since(started),
            payload=_payload(privacy, args=args, kwargs=kwargs, result=result),
        )
        try:
            # 'absent': the entry this attempt's intent created is gone (a store
            # restarted without persistence, an evicted key). Only this owner
            # knows how the write ended; recording it keeps a redelivery of the
            # message from running the write a second time.
            moved = runtime.journal.transition(
                attempt.ref, new_state=JournalState.SUCCEEDED,
                allowed=[JournalState.RUNNING, "absent"], token=attempt.token, event=event,
                earlier_copy=begin.intent_event,
            )
        except StoreUnavailable as store_down:
            failed = AuditPersistenceFailed(
                f"{self.name}[{attempt.task_id}] ran, but its outcome could not be "
                f"recorded: {store_down}",
                body_completed=True,
            )
            if attempt.interactive:
                raise failed from store_down
            self._dead_letter(
                attempt, request, DeadLetterReason.NOT_RETRYABLE, failed,
                FailureClass.UNKNOWN, owned=True, attempts=number, body_completed=True,
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
                raise LeaseLost(f"{self.name}[{attempt.task_id}] finished after losing its lease")
        return result

    def _lease_plan(self, attempt: Attempt, request: Context) -> LeasePlan:
        """Secure the broker lease for the deadline, before anything is recorded.

        On Redis, a write without an ``operation_deadline`` has the visibility
        timeout as its journal lease and nothing is extended: the message comes
        back after it, as with plain Celery. A broker without a visibility
        timeout (RabbitMQ) gives a message back as soon as its holder's channel
        closes, so there every write heartbeats a short journal lease (three
        intervals), with or without a deadline: a redelivery after its owner
        died is settled within one journal lease.
        """
        runtime = self.runtime
        settings = runtime.settings
        now = time.time()
        deadline = self.operation_deadline
        if not deadline:
            if settings.broker_is_redis:
                return LeasePlan(journal_lease_end=now + settings.visibility_timeout)
            interval = heartbeat_interval(settings, None)
            return LeasePlan(journal_lease_end=now + 3 * interval, interval=interval)
        deadline_end = now + float(deadline)
        interval = heartbeat_interval(settings, float(deadline))
        plan = LeasePlan(
            journal_lease_end=min(now + 3 * interval, deadline_end),
            deadline_end=deadline_end,
            interval=interval,
        )
        lease = None if attempt.interactive else runtime.leases.broker_lease(request.properties)
        if lease is None:
            return plan
        verdict = runtime.leases.extend_lease(lease, deadline_end)
        if verdict is LeaseVerdict.OK:
            return replace(plan, broker_lease=lease)
        runtime.audit.record_step(
            attempt.context.event("lease_refused", verdict.value, lease_until=f"{deadline_end:.3f}")
        )
        if verdict is LeaseVerdict.LOST:
            # The message was restored: its other copy will run. Acknowledging
            # ours would delete that copy's lease (the delivery tag is shared).
            raise LeaseLost(f"{self.name}[{attempt.task_id}]: message restored before it began")
        self._after_failure(
            attempt, request,
            LeaseNotSecured(f"{self.name}[{attempt.task_id}] not run: lease not secured "
                            f"({verdict.value})"),
            FailureClass.CONNECTION, attempt.retries + 1, body_started=False,
        )

    def _heartbeat(
        self, attempt: Attempt, plan: LeasePlan
    ) -> contextlib.AbstractContextManager[Any]:
        """The heartbeat of a write whose plan has one; nothing for the others."""
        if plan.interval is None:
            return contextlib.nullcontext()
        runtime = self.runtime

        def lease_failed(why: str) -> None:
            logger.warning("%s[%s]: lease extension failed (%s)", self.name, attempt.task_id, why)
            runtime.audit.record_step(attempt.context.event("lease_extension_failed", why))

        return Heartbeat(
            journal=runtime.journal, ref=attempt.ref, token=attempt.token,
            leases=runtime.leases, broker_lease=plan.broker_lease,
            deadline_end=plan.deadline_end, interval=plan.interval, on_failure=lease_failed,
        )

    def _begin(
        self, attempt: Attempt, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any],
        plan: LeasePlan,
    ) -> Begin:
        """Record the intent of a write, or end this delivery without running it."""
        runtime = self.runtime
        settings = runtime.settings
        lease_note = {} if plan.broker_lease is None else {
            "lease_until": f"{plan.deadline_end:.3f}"
        }
        try:
            begin = runtime.journal.begin_attempt(
                attempt.ref,
                token=attempt.token,
                effect=attempt.effect.value,
                lease_end=plan.journal_lease_end,
                attempts_allowed=self.retry_policy.attempts_allowed,
                event=attempt.context.event(
                    "intent", "started",
                    payload={**_payload(settings.privacy, args=args, kwargs=kwargs), **lease_note},
                ),
            )
        except StoreUnavailable as store_down:
            failed = IntentNotRecorded(
                f"{self.name}[{attempt.task_id}] not run: its intent could not be "
                f"recorded: {store_down}"
            )
            if attempt.interactive:
                raise failed from store_down
            if _already_ended(runtime, attempt) or _already_dead_lettered(
                runtime, attempt.task_id
            ):
                logger.warning("%s[%s] delivered again after it ended; acknowledged without "
                               "running (not audited: %s)", self.name, attempt.task_id,
                               store_down)
                raise Ignore() from None
            self._after_failure(attempt, request, failed, FailureClass.CONNECTION,
                                attempt.retries + 1, body_started=False)

        verdict = begin.verdict
        if verdict is Verdict.STARTED:
            return begin
        if verdict in (Verdict.DONE, Verdict.DEAD_LETTERED, Verdict.NOT_RUN):
            raise Ignore()
        if verdict is Verdict.OWNED:
            self._come_back_later(attempt, request, begin)
        if verdict is Verdict.DEAD_LETTERING:
            self._finish_dead_letter(attempt, request, begin)
        if verdict is Verdict.INTERRUPTED:
            self._dead_letter(
                attempt, request, DeadLetterReason.INTERRUPTED_WRITE,
                InterruptedWrite(
                    f"{self.name}[{attempt.task_id}] started and never finished; "
                    "a non-idempotent write is never run twice"
                ),
                FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
            )
        # Verdict.EXHAUSTED: earlier attempts spent the retry budget (the
        # journal counted how they ended).
        self._dead_letter(
            attempt, request, DeadLetterReason.RETRIES_EXHAUSTED,
            RetriesExhausted(exhausted_text(
                self.name, attempt.task_id, attempts=begin.attempt,
                budget=self.retry_policy.budget, endings=begin.endings or {},
            )),
            FailureClass.UNKNOWN, owned=False, attempts=begin.attempt,
        )

    # -- endings -------------------------------------------------------------

    def _after_failure(
        self,
        attempt: Attempt,
        request: Context,
        exc: Exception,
        failure_class: FailureClass,
        number: int,
        *,
        body_started: bool = True,
        duration_ms: float | None = None,
    ) -> NoReturn:
        """Retry, dead-letter or raise ``exc``; never returns."""
        runtime = self.runtime
        settings = runtime.settings
        policy = self.retry_policy
        context = attempt.context
        journalled = attempt.effect.is_write and body_started
        outcome = context.event(
            "outcome", "failed", attempt=number, duration_ms=duration_ms, exception=exc,
            failure_class=failure_class.value,
            payload=_payload(settings.privacy, error=exc),
        )
        if attempt.interactive:
            if journalled:
                self._settle(attempt, JournalState.FAILED, outcome, cause=exc)
            exc.__dict__.setdefault("failure_class", failure_class.value)
            setattr(exc, AUDITED_MARK, True)
            raise exc
        requested_limit = exc.__dict__.get(REQUESTED_EXHAUSTED_MARK)
        if requested_limit is not None:
            # self.retry() found the budget spent and raised the tool's error.
            spent = RetriesExhausted(
                f"{self.name}[{attempt.task_id}] asked for a retry (self.retry()) after "
                f"{attempt.retries} retries; its retry budget of {requested_limit} is spent. "
                f"Last error: {type(exc).__name__}: {exc}"
            )
            self._dead_letter(
                attempt, request, DeadLetterReason.RETRIES_EXHAUSTED, spent, failure_class,
                owned=journalled, attempts=number, outcome_event=outcome,
            )
        decision = policy.after_failure(
            exc, failure_class, retries=attempt.retries, attempt=number,
            body_started=body_started,
        )
        if decision.retry:
            if journalled:
                retrying = dict(outcome, status="retrying", countdown=f"{decision.countdown:g}")
                try:
                    self._settle(attempt, JournalState.RETRY_SCHEDULED, retrying, cause=exc,
                                 ending=Ending.FAILED)
                except AuditPersistenceFailed as lost:
                    self._dead_letter(
                        attempt, request, DeadLetterReason.NOT_RETRYABLE, lost,
                        FailureClass.UNKNOWN, owned=True, attempts=number,
                    )
            self._publish_retry(request, exc, decision.countdown)
        reason = (DeadLetterReason.RETRIES_EXHAUSTED if decision.exhausted
                  else DeadLetterReason.NOT_RETRYABLE)
        self._dead_letter(
            attempt, request, reason, exc, failure_class, owned=journalled,
            attempts=number, outcome_event=outcome,
        )

    def _settle(
        self, attempt: Attempt, state: JournalState, event: Mapping[str, str], *,
        cause: Exception, ending: Ending | None = None,
    ) -> None:
        """Record a failed attempt's outcome; fail closed when it cannot be stored."""
        try:
            moved = self.runtime.journal.transition(
                attempt.ref, new_state=state, allowed=[JournalState.RUNNING],
                token=attempt.token, event=event, ending=ending,
            )
        except StoreUnavailable as store_down:
            raise AuditPersistenceFailed(
                f"{self.name}[{attempt.task_id}] failed ({type(cause).__name__}) and its "
                f"outcome could not be recorded: {store_down}"
            ) from cause
        if not moved and not attempt.interactive:
            raise LeaseLost(f"{self.name}[{attempt.task_id}] failed after losing its lease")

    def _publish_retry(self, request: Context, exc: Exception, countdown: float) -> NoReturn:
        """Publish the retry; if that fails keep the message (never a deleting Reject)."""
        signature = self.signature_from_request(
            request, countdown=countdown, retries=int(request.retries or 0) + 1
        )
        try:
            signature.apply_async()
        except Exception as publish_failed:
            logger.error("retry of %s[%s] not published, requeueing: %s",
                         self.name, request.id, publish_failed)
            raise Reject(publish_failed, requeue=True) from exc
        raise Retry(exc=exc, when=countdown, sig=signature)

    def _come_back_later(self, attempt: Attempt, request: Context, begin: Begin) -> NoReturn:
        """A live owner runs this task: republish for when its lease ends."""
        wait = max(begin.owner_lease_end - time.time(), 0.0) + 1.0
        settings = self.runtime.settings
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
            raise AttemptInProgress(
                f"{self.name}[{attempt.task_id}] is running elsewhere for {wait:.0f}s more"
            )
        signature = self.signature_from_request(request, countdown=wait)
        try:
            signature.apply_async()
        except Exception as publish_failed:
            raise Reject(publish_failed, requeue=True) from None
        self.runtime.audit.record_step(
            attempt.context.event("deferred", "owned_elsewhere", countdown=f"{wait:.1f}")
        )
        raise Ignore()

    def _finish_dead_letter(self, attempt: Attempt, request: Context, begin: Begin) -> NoReturn:
        """A dead letter was begun but not finished: finish it with its recorded reason."""
        journal = self.runtime.journal.read(attempt.ref)
        try:
            reason = DeadLetterReason(journal.get("reason", ""))
        except ValueError:
            reason = DeadLetterReason.NOT_RETRYABLE
        failure_class = FailureClass.coerce(journal.get("failure_class") or "unknown")
        pending = AuditPersistenceFailed(
            f"{self.name}[{attempt.task_id}]: finishing a dead letter begun earlier "
            f"({journal.get('exception_type', '')})",
            body_completed=journal.get("body_completed") == "1",
        )
        self._dead_letter(
            attempt, request, reason, pending, failure_class, owned=False,
            attempts=begin.attempt, body_completed=pending.body_completed,
            allowed=[JournalState.DEAD_LETTERING],
        )

    def _dead_letter(
        self,
        attempt: Attempt,
        request: Context,
        reason: DeadLetterReason,
        exc: BaseException,
        failure_class: FailureClass,
        *,
        owned: bool,
        attempts: int,
        body_completed: bool = False,
        outcome_event: Mapping[str, str] | None = None,
        allowed: Iterable[JournalState | str] | None = None,
        journalled: bool = True,
    ) -> NoReturn:
        """Decide the dead letter of a queued run (raise for an interactive one).

        The journal moves to ``dead_lettering`` here; the ``DeadLettered``
        raised carries the letter to the worker's main process, which holds
        the message: ``ToolRequest`` stores it with the message as delivered,
        then rejects the message (see :mod:`celery_tooleffect.runtime`).
        """
        if attempt.interactive:
            raise exc
        runtime = self.runtime
        letter = build_letter(
            attempt, reason=reason, failure_class=failure_class, exc=exc,
            attempts=attempts, body_completed=body_completed,
        )
        event = outcome_event or attempt.context.event(
            "outcome", reason.value, attempt=attempts or None, exception=exc,
            failure_class=failure_class.value,
        )
        rejection = runtime.begin_dead_letter(
            attempt, letter, outcome_event=event, owned=owned, exc=exc,
            allowed=allowed, journalled=journalled and attempt.effect.is_write,
        )
        raise rejection from exc


def _requested_retry_event(attempt: Attempt, number: int, requested: Retry) -> dict[str, str]:
    """The audit event of a retry the tool asked for (``self.retry()``)."""
    cause = requested.exc if isinstance(requested.exc, BaseException) else None
    event = attempt.context.event("outcome", "retrying", attempt=number, exception=cause,
                                  requested="1")
    if isinstance(requested.when, (int, float)):
        event["countdown"] = f"{requested.when:g}"
    return event


def _overridden(cls: type) -> set[str]:
    """Names a tool class defines below ``ToolTask``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is ToolTask:
            break
        names.update(klass.__dict__)
    return names


def _refuse_relabel(name: str, options: Mapping[str, Any]) -> None:
    refused = sorted(set(options) & PROTECTED_OPTIONS)
    headers = options.get("headers") or {}
    forged = forged_headers(headers) if isinstance(headers, Mapping) else []
    forged += forged_headers(options)
    if refused or forged:
        raise EffectRelabelRefused(
            f"{name}: a call may not set {', '.join(refused + forged)}; "
            "a tool's effect and guarantees are declared in code"
        )


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
    return state in (JournalState.SUCCEEDED.value, JournalState.DEAD_LETTERED.value)


def _already_dead_lettered(runtime: ToolRuntime, task_id: str) -> bool:
    try:
        return runtime.dead_letters.exists(task_id)
    except StoreUnavailable:
        return False


def _payload(privacy: str, **values: Any) -> dict[str, str]:
    return describe_payload(privacy, **values)


def _ms_since(started: float) -> float:
    return (time.monotonic() - started) * 1000.0
