"""``ToolTask``: the Celery task base class that makes a task a safe agent tool.

This module declares a tool: its effect, deadline and retry budget, what
binding it to an app checks, and how it is called. How a call runs (journal,
heartbeat, outcome, retry or dead letter) is
:mod:`celery_tooleffect.worker.execution`, as Celery's ``Task`` is run by
``celery/app/trace.py``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from celery import Task
from celery.app.annotations import resolve_all as resolve_all_annotations
from celery.exceptions import Reject, Retry

from .effect import ToolEffect, ToolEffectResolver
from .errors import (
    CallIdConflict,
    DeadLettered,
    EffectRelabelRefused,
    InvalidCallId,
    ToolContextError,
    ToolDeclarationError,
)
from .identity import (
    CALL_ID_HEADER,
    CALLER_HEADER,
    RUN_ID_HEADER,
    call_task_id,
    checked_id,
    conflict_text,
    publish_digest,
)
from .reconciliation import Reconciliation
from .settings import refuse_unknown_settings
from .states import Approver, approver_of
from .store.runtime import ToolRuntime, runtime_for
from .worker.approval_gate import install_approval_sweep
from .worker.attempt import (
    AGAIN_HEADER,
    REPUBLISH_OPTION,
    forged_headers,
    idempotency_key,
    resolve_run_id,
)
from .worker.children import ParentCall, current_parent
from .worker.consumer import install_consumer_step
from .worker.execution import acknowledge_success, run_tool
from .worker.fetch import install_atomic_fetch
from .worker.handoff import (
    attempt_notes,
    existing_notes,
    hand_over,
    hide_handoff,
    hold_retry,
    holding_retry,
)
from .worker.retries import (
    RetryPolicy,
    refuse_autoretry,
    refuse_unbounded_retries,
)
from .worker.signals import connect_signals, stamp_sent_at
from .worker.startup import install_startup_checks

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
        "reconcile",
        "requires_approval",
        "needs_approval",
        "approval_view",
    }
)


class ToolTask(Task):  # type: ignore[misc]
    """Base class of agent tools. See the package README for the guarantees."""

    #: The tool's side effect; a tool that declares nothing is READ_ONLY.
    effect: ClassVar[ToolEffect | str | None] = None
    #: Seconds a write may take; its lease is secured for this long.
    operation_deadline: ClassVar[float | None] = None
    #: Whether the tool reaches outside the system (MCP ``openWorldHint``).
    open_world: ClassVar[bool] = True
    #: A NON_IDEMPOTENT_WRITE's answer to "did the interrupted attempt's write
    #: happen?": ``reconcile(self, *args, **kwargs) -> Reconciliation`` (a
    #: method, or the ``reconcile=`` option of ``@app.task``); None: it cannot
    #: tell, and an interrupted write is a dead letter.
    reconcile: ClassVar[Callable[..., Reconciliation] | None] = None
    #: A write whose calls a person approves before they run: True (an
    #: operator approves every call), an :class:`Approver` (or its value:
    #: ``"user"``, the agent's user; ``"both"``, the user then an operator), or
    #: a policy ``requires_approval(self, *args, **kwargs)`` answering one of
    #: these, or False for a call that needs none (a method, or the
    #: ``requires_approval=`` option of ``@app.task``).
    requires_approval: ClassVar[bool | Approver | str | Callable[..., bool | Approver | str]] = (
        False)
    #: How a call's arguments are shown to the people who approve it:
    #: ``approval_view(self, *args, **kwargs) -> Mapping[str, Any]`` (a method,
    #: or the ``approval_view=`` option of ``@app.task``), e.g. a card number
    #: masked; None: the arguments as the message carries them.
    approval_view: ClassVar[Callable[..., Mapping[str, Any]] | None] = None

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    retry_on_worker_lost = False
    acks_on_failure_or_timeout = False
    Request = "celery_tooleffect.worker.request:ToolRequest"
    Strategy = "celery_tooleffect.worker.strategy:tool_strategy"

    # -- binding and declaration -------------------------------------------

    #: True for Celery's own tasks when the app's ``task_cls`` is a tool
    #: (:func:`is_celery_builtin`): they stay plain Celery tasks.
    _tooleffect_plain: ClassVar[bool] = False

    @classmethod
    def bind(cls, app: Any) -> Any:
        if is_celery_builtin(cls):
            # ``task_cls = "celery_tooleffect:ToolTask"`` makes every task of
            # the app a subclass, Celery's own too (chord_unlock retries
            # forever, backend_cleanup, the canvas helpers). They keep
            # Celery's behaviour: its request, strategy and acks, from config.
            for name in _PLAIN_ATTRIBUTES:
                if name not in cls.__dict__:
                    setattr(cls, name, getattr(Task, name))
            cls._tooleffect_plain = True
            return super().bind(app)
        bound = super().bind(app)
        declared = (
            ToolEffect.coerce(cls.effect) if cls.effect is not None else ToolEffect.READ_ONLY
        )
        if cls.operation_deadline is not None and float(cls.operation_deadline) <= 0:
            raise ToolDeclarationError(f"{cls.name}: operation_deadline must be positive")
        if (
            declared.is_write
            and cls.operation_deadline is not None
            and cls.time_limit is not None
            and float(cls.time_limit) > float(cls.operation_deadline)
        ):
            raise ToolDeclarationError(
                f"{cls.name}: time_limit {cls.time_limit}s is longer than its "
                f"operation_deadline {cls.operation_deadline}s"
            )
        if cls.approval_view is not None and not cls.requires_approval:
            raise ToolDeclarationError(
                f"{cls.name}: approval_view shows a call to the people who approve it; "
                "the tool declares no requires_approval")
        if not callable(cls.requires_approval):
            try:
                approver_of(cls.requires_approval)
            except ValueError as exc:
                raise ToolDeclarationError(f"{cls.name}: requires_approval: {exc}") from None
        if cls.requires_approval and not declared.is_write:
            raise ToolDeclarationError(
                f"{cls.name}: a READ_ONLY tool changes nothing, so there is nothing to "
                "approve (requires_approval is for writes)"
            )
        refuse_unknown_settings(app.conf)
        if "get_effect" not in _overridden(cls):
            refuse_autoretry(cls, declared)
        refuse_unbounded_retries(cls)
        if declared.is_write or "get_effect" in _overridden(cls):
            stamp_sent_at(cls.name)
        connect_signals()
        install_consumer_step(app)
        install_atomic_fetch(app)
        install_approval_sweep(app)
        install_startup_checks(app)
        return bound

    @classmethod
    def annotate(cls) -> None:
        if cls._tooleffect_plain:
            super().annotate()
            return
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
        """The effect this tool declares, resolved once (``AttributeError`` on
        Celery's own tasks: they are no tools)."""
        if self._tooleffect_plain:
            raise AttributeError(f"{self.name} is Celery's own task, not a tool")
        resolved = self.__dict__.get("_tool_effect")
        if resolved is None:
            resolved = ToolEffectResolver.effect_for_tool(self)
            refuse_autoretry(self, resolved)
            self.__dict__["_tool_effect"] = resolved
        return resolved

    @property
    def retry_policy(self) -> RetryPolicy:
        """This tool's retry budget and backoff (see :mod:`celery_tooleffect.worker.retries`)."""
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
        if self._tooleffect_plain:
            return int(Task.max_retries)
        return self.retry_policy.budget

    @property
    def idempotency_key(self) -> str:
        """This task's idempotency key, for providers that deduplicate (an
        ``Idempotency-Key`` header, a client token).

        The same for every delivery, retry and replay of the task, different
        for another task; derived from the run id and the task id, and
        recorded in the intent event. Read it in the body of a bound tool
        (``bind=True``); elsewhere it raises :class:`ToolContextError`.
        """
        request = self.request
        if request.id is None:
            raise ToolContextError(
                f"{self.name}: idempotency_key is known only while the tool runs"
            )
        task_id = str(request.id)
        return idempotency_key(resolve_run_id(vars(request), task_id), task_id)

    @property
    def fencing_token(self) -> int:
        """This attempt's fencing token: strictly greater than that of every
        earlier attempt of the task (retries, redeliveries and replays
        included), taken from the journal with the intent and recorded in the
        intent event. A downstream store that keeps the highest token it saw
        can refuse the late write of a stale owner.

        Only a write has one (a READ_ONLY tool keeps no journal), and only
        while its body runs; elsewhere it raises :class:`ToolContextError`.
        """
        notes = existing_notes(self.request)
        token = notes.fencing_token if notes is not None else None
        if token is None:
            raise ToolContextError(
                f"{self.name}: a fencing token exists only while a write's body runs "
                f"(this tool is {self.tool_effect.value})"
            )
        return int(token)

    def reconciler(
        self, check: Callable[..., Reconciliation]
    ) -> Callable[..., Reconciliation]:
        """Declare ``check(self, *args, **kwargs)`` as this tool's ``reconcile``
        (a decorator: ``@charge_card.reconciler``), as the ``reconcile=`` option
        of ``@app.task`` does. Only a write reconciles, and only once.
        """
        if not self.tool_effect.is_write:
            raise ToolDeclarationError(
                f"{self.name}: a READ_ONLY tool runs again after an interruption; "
                "it has nothing to reconcile"
            )
        if type(self).reconcile is not None:
            raise ToolDeclarationError(f"{self.name} declares its reconcile already")
        type(self).reconcile = check
        return check

    def needs_approval(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call waits for a person's approval, as the tool declares
        (``requires_approval``)."""
        return self.approver_for(args, kwargs) is not None

    def approver_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Approver | None:
        """Who approves this call (``requires_approval``); None: it needs no
        approval. A policy that raises, or answers what is no approver, counts
        as an operator's approval: a call is never let through because its
        check failed."""
        policy = type(self).requires_approval
        if callable(policy):
            try:
                policy = policy(self, *args, **kwargs)
            except Exception:
                logger.exception("%s: requires_approval raised; the call waits for an "
                                 "operator's approval", self.name)
                return Approver.OPERATOR
        try:
            return approver_of(policy)
        except ValueError:
            logger.error("%s: requires_approval answered %r, no approver; the call waits for "
                         "an operator's approval", self.name, policy)
            return Approver.OPERATOR

    def mcp_annotations(self) -> dict[str, bool]:
        """MCP tool annotations of this tool."""
        return self.tool_effect.mcp_annotations(open_world=self.open_world)

    @property
    def runtime(self) -> ToolRuntime:
        return runtime_for(self.app)

    # -- calling -------------------------------------------------------------

    def signature_from_request(self, request: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Celery's, marked as a republish of the task from its own request
        (every one goes through here: a retry in the pool, a run again or a
        deferral in the worker's main process): it claims no task id
        (``apply_async``), and carries none of what the main process handed
        its pool (``hide_handoff``: Celery copies the request's headers on)."""
        if request is None:
            request = self.request
        if not self._tooleffect_plain:
            hide_handoff(request)
        signature = super().signature_from_request(request, *args, **kwargs)
        if self._tooleffect_plain:
            return signature
        signature.options[REPUBLISH_OPTION] = True
        # Celery passes the request's headers on (Context.as_execution_options):
        # the copy says it is one, so a READ_ONLY release asks the journal.
        headers = signature.options.get("headers")
        signature.options["headers"] = {**(headers if isinstance(headers, dict) else {}),
                                        AGAIN_HEADER: "1"}
        return signature

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
        if self._tooleffect_plain:
            return super().retry(args, kwargs, exc, throw, eta, countdown,
                                 max_retries=max_retries, **options)
        budget = self.retry_policy.budget
        limit = budget if max_retries is None else min(int(max_retries), budget)
        request = self.request
        spent = not request.called_directly and int(request.retries or 0) + 1 > limit
        try:
            # In a write's body the retry is sent once the attempt has left
            # 'running' (worker/execution.py), not while Celery "sends" it.
            with holding_retry(request):
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
                # For the failure handling of this attempt, in this process
                # (worker/endings.py): the attempt's notes, not a mark on the
                # error, which would travel on with it.
                attempt_notes(request).retries_spent = (raised, limit)
            raise

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Celery's ``apply_async``, with the call's identity (``docs/identity.md``):

        - ``call_id=`` (with ``run_id=``): the agent's own id of the tool call;
          the task id is derived from both (:func:`celery_tooleffect.call_task_id`),
          so a call re-sent after any crash is the same call;
        - ``run_id=``: the run the call belongs to (the ``tooleffect_run_id`` header);
        - in a tool's body, a call without a task id gets one derived from
          the parent (``step=`` names it instead of its ordinal).

        A task id the caller chose (``task_id=``, ``call_id=``, a child's) is
        claimed for this tool and these arguments first, one round trip:
        :class:`CallIdConflict` when it is another call's. Raises
        :class:`InvalidCallId` for an id that cannot be one.
        """
        republish = bool(options.pop(REPUBLISH_OPTION, False))
        if self._tooleffect_plain:
            return super().apply_async(args, kwargs, **options)
        if republish and hold_retry(self.request, args, kwargs,
                                    {**options, REPUBLISH_OPTION: True}):
            return None  # a write's own retry (see retry): Celery ignores this
        _refuse_relabel(self.name, options)
        claim = self._identify(options, republish=republish)
        if claim:
            self._claim(str(options["task_id"]), args, kwargs, options)
        return super().apply_async(args, kwargs, **options)

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        options.pop(REPUBLISH_OPTION, None)
        if self._tooleffect_plain:
            return super().apply(args, kwargs, **options)
        _refuse_relabel(self.name, options)
        step = options.pop("step", None)
        parent = current_parent()
        if parent is not None and options.get("task_id") is None:
            options["task_id"] = parent.child_id(self.name, step)
            options["headers"] = {**(options.get("headers") or {}), RUN_ID_HEADER: parent.run_id,
                                  **_caller_of(parent)}
        elif step is not None:
            raise InvalidCallId(f"{self.name}: step= names a tool called in a tool's body")
        return super().apply(args, kwargs, **options)

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any,
                     einfo: Any) -> None:
        # Celery's tracer (celery/app/trace.py) calls this once it stored the
        # result: a success the main process acknowledges nothing of is
        # acknowledged here, if no script of the call did it.
        if not self._tooleffect_plain and status == "SUCCESS":
            acknowledge_success(self, self.request)
        super().after_return(status, retval, task_id, args, kwargs, einfo)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._tooleffect_plain:
            return super().__call__(*args, **kwargs)
        request = self.request
        if request.id is not None:
            hide_handoff(request)
            try:
                return run_tool(self, request, args, kwargs)
            except DeadLettered as rejection:
                ending = hand_over(request, rejection)
                if ending is rejection:
                    raise
            # A dead letter whose result is the tool's own error: raised for
            # Celery's tracer to store and report as plain Celery does (outside
            # the except clause, so that its __context__ stays its own).
            raise ending
        # A direct call: give it a task id so that a write is journalled
        # exactly like a queued one. In a tool's body the id is derived from
        # the parent, and the call is in the parent's run; elsewhere it is
        # new, and its run id is that task id.
        parent = current_parent()
        if parent is None:
            task_id = uuid.uuid4().hex
            lineage = {"root_id": task_id}
        else:
            task_id = parent.child_id(self.name)
            lineage = {"root_id": parent.run_id, "parent_id": parent.task_id,
                       RUN_ID_HEADER: parent.run_id, **_caller_of(parent)}
        self.push_request(
            args=args, kwargs=kwargs, id=task_id, is_eager=True, called_directly=True,
            **lineage,
        )
        try:
            return run_tool(self, self.request, args, kwargs)
        finally:
            self.pop_request()

    # -- call identity (docs/identity.md) --------------------------------------

    def _identify(self, options: dict[str, Any], *, republish: bool) -> bool:
        """Give the call its task id and run (in ``options``); True when the
        caller chose the id, so that it must be claimed before publishing.
        ``republish``: the task published again from its own request."""
        call_id = options.pop("call_id", None)
        run_id = options.pop("run_id", None)
        step = options.pop("step", None)
        parent = None if republish else current_parent()
        headers = dict(options.get("headers") or {})
        if run_id is not None:
            headers[RUN_ID_HEADER] = checked_id(run_id, "run_id")
        elif parent is not None:
            headers.setdefault(RUN_ID_HEADER, parent.run_id)
        if parent is not None and parent.caller:
            # A child is part of the call that made it: the same caller.
            headers.setdefault(CALLER_HEADER, parent.caller)
        if step is not None and (parent is None or call_id is not None
                                 or options.get("task_id") is not None):
            raise InvalidCallId(f"{self.name}: step= names a tool called in a tool's body "
                                "without a task id or call id of its own")
        claim = False
        if call_id is not None:
            if options.get("task_id") is not None:
                raise InvalidCallId(f"{self.name}: give call_id= or task_id=, not both")
            call_id = checked_id(call_id, "call_id")
            options["task_id"] = call_task_id(call_id, headers.get(RUN_ID_HEADER, ""))
            headers[CALL_ID_HEADER] = call_id
            claim = True
        elif options.get("task_id") is None:
            if parent is not None:
                options["task_id"] = parent.child_id(self.name, step)
                claim = True
        elif not republish:
            # Celery's canvas publishes its members with the ids it froze
            # (group_id, chord, chain, parent_id, root_id among the options):
            # those it chose; the worker's journal checks them.
            claim = not any(options.get(name) is not None for name in CANVAS_OPTIONS)
        if headers:
            options["headers"] = headers
        return claim

    def _claim(self, task_id: str, args: Any, kwargs: Any, options: Mapping[str, Any]) -> None:
        """Claim ``task_id`` for this tool and these arguments, or raise
        :class:`CallIdConflict`; kombu's ``EncodeError`` for arguments the
        message's serializer cannot encode, as Celery's publish would."""
        serializer = options.get("serializer") or self.serializer or self.app.conf.task_serializer
        digest = publish_digest(args or (), kwargs or {}, serializer)
        claim = self.runtime.calls.claim(task_id, self.name, digest)
        if not claim:
            raise CallIdConflict(
                conflict_text(task_id, self.name, claim.recorded_tool, claim.conflict),
                task_id=task_id, tool=self.name, recorded_tool=claim.recorded_tool,
                conflict=claim.conflict,
            )


#: Options with which Celery's canvas publishes a member under the id it froze.
CANVAS_OPTIONS = ("group_id", "group_index", "chord", "chain", "parent_id", "root_id")


#: What Celery's own tasks take from ``celery.Task`` rather than from ToolTask.
_PLAIN_ATTRIBUTES = ("acks_late", "acks_on_failure_or_timeout", "reject_on_worker_lost",
                     "retry_on_worker_lost", "Request", "Strategy")


def is_celery_builtin(cls: type) -> bool:
    """Whether ``cls`` is one of Celery's own tasks (``celery/app/builtins.py``:
    ``celery.chord_unlock``, ``celery.backend_cleanup``, ``celery.group`` ...),
    made a ToolTask subclass by the app's ``task_cls``."""
    return cls.__module__ == "celery.app.builtins"


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


def _caller_of(parent: ParentCall) -> dict[str, str]:
    """The caller header a child of ``parent`` carries: its parent's, if any."""
    return {CALLER_HEADER: parent.caller} if parent.caller else {}
