"""The approval gate: a call that needs a person's approval waits for one.

The worker's main process, which holds the message, asks :func:`gate` before
it hands a tool's request to the pool: the consumer's ``on_task_request`` is
wrapped by the :class:`ApprovalSweep` bootstep when the consumer is built,
before Celery builds the task strategies that capture it (Celery's
``create_request_cls`` replaces a request class's ``execute_using_pool``, so
the request class cannot be the hook). Requests scheduled by ``eta`` or a rate
limit reach the pool through the same ``on_task_request``. For a tool that declares
``requires_approval`` (and, for a policy, only for the calls it names) the
store decides, never the message:

- no record: the call is **parked**: its record (the message as delivered,
  who asked, its arguments at ``tooleffect_privacy``) and the ``approval
  requested`` event are stored by one script, the ``approval_requested`` signal
  fires, and only then is the message acknowledged; nothing of the body runs.
  If the store does not answer, the message is requeued, never acknowledged;
- ``pending``: a redelivery of a parked call (its worker died before the
  acknowledgement): acknowledged, still one record;
- ``approved``: the call runs under the journal's rules like any other;
- ``rejected`` or ``expired``: the call ends FAILURE with ``ApprovalRejected``
  as Celery ends a failed task (result stored, chord told, ``link_error``
  callbacks run, ``task-failed`` event), then the record moves to ``ended``
  and the message is acknowledged; ``ended``: acknowledged.

A decision (:func:`decide`, used by the operator commands and by the sweep
of calls nobody decided within ``tooleffect_approval_timeout``) moves a
``pending`` record once, with its audit event, then publishes the kept
message again (the same bytes, headers and properties), and takes the call
off the pending index. A decision whose message could not be published stays
listed and is published by the next sweep or decision attempt; a message
published twice is harmless (the journal runs a task id once, and a refused
call ends once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from celery import bootsteps
from celery import signals as celery_signals
from celery.utils.saferepr import saferepr
from celery.worker import state as worker_state

from ..effect import ToolEffect
from ..errors import ApprovalRejected, StoreUnavailable
from ..events import AuditEvent
from ..signals import approval_requested
from ..states import ApprovalState
from ..store import states
from ..store.approvals import Approval, ApprovalMove, overdue_before
from ..store.audit import StepContext, describe_payload, worker_identity
from ..store.envelope import MessageEnvelope
from ..store.runtime import ToolRuntime, runtime_for
from . import telemetry
from .attempt import Attempt
from .handoff import exception_info
from .republish import republish
from .signals import AUDITED_MARK

logger = logging.getLogger(__name__)

#: How often a worker looks for calls nobody decided in time (seconds, at most).
SWEEP_INTERVAL = 60.0


def needs_approval(task: Any, args: Any, kwargs: Any) -> bool:
    """Whether this call of ``task`` waits for a person (cheap when it never does)."""
    if not getattr(task, "requires_approval", False):
        return False
    return bool(task.needs_approval(tuple(args or ()), dict(kwargs or {})))


# -- in the worker's main process, before the pool ---------------------------------


def gate(request: Any) -> bool:
    """Let ``request`` (a ``ToolRequest``) through (False) or end its delivery
    here (True); see the module docs."""
    if request.handoff.forged:
        # A message that sets the package's own headers is dead-lettered by
        # the pool process before anything runs.
        return False
    if not needs_approval(request.task, request.args, request.kwargs):
        return False
    attempt: Attempt = request._attempt()
    runtime = runtime_for(request.task.app)
    try:
        state = runtime.approvals.state(attempt.run_id, attempt.task_id)
        if state is ApprovalState.ABSENT:
            state = _park(request, attempt, runtime)
    except StoreUnavailable as store_down:
        logger.error("%s[%s] needs approval and the store did not answer; requeueing the "
                     "message: %s", request.name, request.id, store_down)
        _end_delivery(request, requeue=True)
        return True
    if state is ApprovalState.APPROVED:
        request.handoff = replace(request.handoff, approved=True)
        return False
    if state in (ApprovalState.REJECTED, ApprovalState.EXPIRED):
        _end_refused(request, attempt, runtime, state)
    _end_delivery(request)
    return True


def _park(request: Any, attempt: Attempt, runtime: ToolRuntime) -> ApprovalState:
    """Store the call's record and its event; the state it is in afterwards."""
    arguments = describe_payload(runtime.settings.privacy, args=list(request.args),
                                 kwargs=dict(request.kwargs))
    approval = Approval(
        task_id=attempt.task_id, run_id=attempt.run_id, name=attempt.name,
        queue=attempt.queue, effect=attempt.effect.value, state=ApprovalState.PENDING,
        requested_at=time.time(), arguments=arguments, worker=attempt.context.worker,
        message=MessageEnvelope.of_message(request._message),
    )
    existing = runtime.approvals.request(
        approval, attempt.context.event("approval", "requested", payload=arguments)
    )
    if existing is not None:
        return existing
    logger.info("%s[%s] parked until a person approves it", request.name, request.id)
    telemetry.approval_requested(attempt, request._message.headers)
    approval_requested.send(sender=request.task, approval=approval)
    return ApprovalState.PENDING


def _end_refused(request: Any, attempt: Attempt, runtime: ToolRuntime,
                 state: ApprovalState) -> None:
    """End a rejected or expired call FAILURE as Celery ends a failed task."""
    approval = runtime.approvals.get(attempt.task_id)
    why = approval.reason if approval is not None and approval.reason else ""
    by = approval.decided_by if approval is not None else ""
    verb = "expired awaiting approval" if state is ApprovalState.EXPIRED else "rejected"
    exc = ApprovalRejected(
        f"{request.name}[{request.id}] {verb}" + (f" by {by}" if by else "")
        + (f": {why}" if why else "") + "; nothing ran"
    )
    exc.__dict__[AUDITED_MARK] = True  # audited below, with the record's move
    einfo = exception_info(exc)
    # Result FAILURE, the chord's part, link_error callbacks (errbacks with
    # (request, exc, traceback) are called here, as Celery's pool would).
    request.task.backend.mark_as_failure(request.id, exc, request=request._context,
                                         store_result=request.store_errors)
    celery_signals.task_failure.send(
        sender=request.task, task_id=request.id, exception=exc, args=request.args,
        kwargs=request.kwargs, traceback=einfo.traceback, einfo=einfo,
    )
    request.send_event("task-failed", exception=saferepr(exc), traceback=einfo.traceback,
                       failure_class="client_error")
    if approval is not None:
        try:
            runtime.approvals.transition(
                approval, new_state=ApprovalState.ENDED, allowed=states.END_REFUSED_FROM,
                event=attempt.context.event("outcome", state.value, exception=exc,
                                            failure_class="client_error"),
            )
        except StoreUnavailable as store_down:
            # A later delivery ends it again (the result stored again, the
            # callbacks called again: at least once, as Celery's acks_late).
            logger.warning("%s[%s] ended FAILURE; its approval record not moved: %s",
                           request.name, request.id, store_down)


def _end_delivery(request: Any, *, requeue: bool = False) -> None:
    worker_state.task_ready(request)
    if requeue:
        request.reject(requeue=True)
    else:
        request.acknowledge()


# -- decisions (operators, the sweep) -----------------------------------------------


def decision_event(approval: Approval, state: ApprovalState, *, by: str,
                   reason: str, via: str, shown: Mapping[str, str] | None = None
                   ) -> AuditEvent:
    """The audit event of a decision on ``approval``; ``shown``: what the
    person deciding was shown of the call (``shown_digest``, and at privacy
    ``full`` the ``shown`` values)."""
    context = StepContext(
        run_id=approval.run_id, task_id=approval.task_id, tool=approval.name,
        effect=ToolEffect.coerce(approval.effect), queue=approval.queue, redelivered=False,
        worker=worker_identity(),
    )
    details: dict[str, Any] = {"actor": by, "reason": reason, "via": via, **(shown or {})}
    return context.event("approval", state.value, **details)


def decide(app: Any, approval: Approval, state: ApprovalState, *, by: str,
           reason: str, via: str, shown: Mapping[str, str] | None = None) -> ApprovalMove:
    """Take the decision ``state`` (approved, rejected, expired) on a pending call,
    once, then publish its message again and take it off the pending index.

    The answer is false when the call was not pending (then nothing changed);
    a call decided before whose message was not published yet is published
    now. Raises :class:`StoreUnavailable`, or what publishing raises (the
    decision then stays recorded and listed, and is published later).
    """
    runtime = runtime_for(app)
    move = runtime.approvals.transition(
        approval, new_state=state, allowed=states.DECIDE_FROM,
        event=decision_event(approval, state, by=by, reason=reason, via=via, shown=shown),
        fields={"decided_by": by, "decided_at": f"{time.time():.6f}", "reason": reason},
    )
    if move or _listed_but_decided(runtime, approval):
        publish_decided(app, approval)
        runtime.approvals.unlist(approval.task_id)
    return move


def _listed_but_decided(runtime: ToolRuntime, approval: Approval) -> bool:
    current = runtime.approvals.get(approval.task_id)
    return (current is not None and current.decided
            and runtime.approvals.is_listed(approval.task_id))


def publish_decided(app: Any, approval: Approval) -> None:
    """Publish the call's kept message again, exactly as it was delivered."""
    if approval.message is None:
        raise ValueError(f"{approval.name}[{approval.task_id}]: no message kept")
    republish(app, approval.message, approval.queue)


def expire_overdue(app: Any, now: float | None = None) -> list[Approval]:
    """Reject as expired every call parked longer than ``tooleffect_approval_timeout``
    (and publish decisions left unpublished); the calls expired now."""
    runtime = runtime_for(app)
    expired = []
    for approval in runtime.approvals.listed(older_than=overdue_before(runtime.settings, now)):
        if approval.decided:
            publish_decided(app, approval)
            runtime.approvals.unlist(approval.task_id)
            continue
        move = decide(app, approval, ApprovalState.EXPIRED, by="tooleffect", via="sweep",
                      reason="no decision within tooleffect_approval_timeout "
                             f"({runtime.settings.approval_timeout:g} s)")
        if move:
            expired.append(approval)
    return expired


# -- the worker's sweep -----------------------------------------------------------------


def install_approval_sweep(app: Any) -> None:
    """Make workers of ``app`` gate and expire calls that need approval
    (idempotent: ``app.steps["consumer"]`` is a set)."""
    app.steps["consumer"].add(ApprovalSweep)


class ApprovalSweep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: puts :func:`gate` before the pool, and every so often
    rejects as expired the calls of this app that waited longer than
    ``tooleffect_approval_timeout`` (only in workers of apps with a tool that
    needs approval)."""

    name = "celery_tooleffect.consumer.ApprovalSweep"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.tref: Any = None
        if not parent.__dict__.get(_GATED):
            parent.on_task_request = _gated(parent.on_task_request)
            parent.__dict__[_GATED] = True

    def start(self, consumer: Any) -> None:
        app = consumer.app
        if not any(getattr(task, "requires_approval", False) for task in app.tasks.values()):
            return
        interval = min(SWEEP_INTERVAL, max(1.0, runtime_for(app).settings.approval_timeout / 4))
        self.tref = consumer.timer.call_repeatedly(interval, _sweep_quietly(app))

    def stop(self, consumer: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


#: Set on a consumer whose ``on_task_request`` is wrapped, so it is wrapped once.
_GATED = "_tooleffect_approval_gate"


def _gated(on_task_request: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def on_tool_request(request: Any) -> Any:
        # Only tools that declare requires_approval: one attribute read for the rest.
        if getattr(request.task, "requires_approval", False) and gate(request):
            request._tooleffect_done = True
            return None
        return on_task_request(request)

    return on_tool_request


def _sweep_quietly(app: Any) -> Callable[[], None]:
    def sweep() -> None:
        try:
            for approval in expire_overdue(app):
                logger.warning("%s[%s] expired awaiting approval", approval.name,
                               approval.task_id)
        except Exception as exc:  # the next sweep tries again
            logger.warning("approval sweep failed: %s: %s", type(exc).__name__, exc)

    return sweep
