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
- ``user_approved`` (a tool approved by its user, then an operator) without
  a message: its user approved it before it was published; the record takes
  this message and waits for an operator as a parked call does;
- ``approved``: the call runs under the journal's rules like any other, if
  its arguments show the digest its user was shown (else it ends FAILURE
  with ``ApprovalRejected``: another call than the one approved);
- ``rejected`` or ``expired``: the call ends FAILURE with ``ApprovalRejected``
  as Celery ends a failed task (result stored, chord told, ``link_error``
  callbacks run, ``task-failed`` event), then the record moves to ``ended``
  and the message is acknowledged; ``ended``: acknowledged.

A decision (:func:`~celery_tooleffect.actions.approving.decide_approval`)
publishes the kept message again; this module's :class:`ApprovalSweep` runs
:func:`~celery_tooleffect.actions.approving.expire_overdue_approvals` every so
often.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from celery import bootsteps
from celery import signals as celery_signals
from celery.utils.saferepr import saferepr
from celery.worker import state as worker_state

from ..actions.approving import expire_overdue_approvals
from ..actions.showing import show_call
from ..errors import ApprovalRejected, StoreUnavailable
from ..signals import approval_requested
from ..states import ApprovalState, Approver
from ..store import states
from ..store.approvals import Approval
from ..store.audit import describe_payload
from ..store.envelope import MessageEnvelope
from ..store.runtime import ToolRuntime, runtime_for
from . import telemetry
from .attempt import Attempt
from .handoff import attempt_notes, exception_info

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
        state, digest = runtime.approvals.decision(attempt.run_id, attempt.task_id)
        if state in (ApprovalState.ABSENT, ApprovalState.USER_APPROVED):
            state = _park(request, attempt, runtime)
    except StoreUnavailable as store_down:
        logger.error("%s[%s] needs approval and the store did not answer; requeueing the "
                     "message: %s", request.name, request.id, store_down)
        _end_delivery(request, requeue=True)
        return True
    if state is ApprovalState.APPROVED:
        if digest and digest != show_call(request.task, request.args, request.kwargs).digest:
            _end_refused(request, attempt, runtime, state)
            _end_delivery(request)
            return True
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
    approver = request.task.approver_for(tuple(request.args or ()), dict(request.kwargs or {}))
    approval = Approval(
        task_id=attempt.task_id, run_id=attempt.run_id, name=attempt.name,
        queue=attempt.queue, effect=attempt.effect.value, state=ApprovalState.PENDING,
        requested_at=time.time(), arguments=arguments, worker=attempt.context.worker,
        message=MessageEnvelope.of_message(request._message),
        approver=(approver or Approver.OPERATOR).value,
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
    """End a refused call FAILURE as Celery ends a failed task: rejected,
    expired, or approved for other arguments than these (``state`` approved)."""
    approval = runtime.approvals.get(attempt.task_id)
    why = approval.reason if approval is not None and approval.reason else ""
    by = approval.decided_by if approval is not None else ""
    if state is ApprovalState.APPROVED:
        exc = ApprovalRejected(
            f"{request.name}[{request.id}] was approved" + (f" by {by}" if by else "")
            + " for other arguments than this message carries (another digest of what "
            "is shown); nothing ran")
    else:
        verb = "expired awaiting approval" if state is ApprovalState.EXPIRED else "rejected"
        exc = ApprovalRejected(
            f"{request.name}[{request.id}] {verb}" + (f" by {by}" if by else "")
            + (f": {why}" if why else "") + "; nothing ran"
        )
    einfo = exception_info(exc)
    # Result FAILURE, the chord's part, link_error callbacks (errbacks with
    # (request, exc, traceback) are called here, as Celery's pool would).
    request.task.backend.mark_as_failure(request.id, exc, request=request._context,
                                         store_result=request.store_errors)
    # Audited below, with the record's move: noted in the attempt's notes for
    # the task_failure handler, which reads them off the request it reports
    # (pushed as Celery's main process pushes it for the failures it reports).
    attempt_notes(request._context).audited = exc
    request.task.request_stack.push(request._context)
    try:
        celery_signals.task_failure.send(
            sender=request.task, task_id=request.id, exception=exc, args=request.args,
            kwargs=request.kwargs, traceback=einfo.traceback, einfo=einfo,
        )
    finally:
        request.task.request_stack.pop()
    request.send_event("task-failed", exception=saferepr(exc), traceback=einfo.traceback,
                       failure_class="client_error")
    if approval is not None:
        try:
            runtime.approvals.transition(
                approval, new_state=ApprovalState.ENDED,
                allowed=states.END_REFUSED_FROM | {ApprovalState.APPROVED},
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
            for approval in expire_overdue_approvals(app):
                logger.warning("%s[%s] expired awaiting approval", approval.name,
                               approval.task_id)
        except Exception as exc:  # the next sweep tries again
            logger.warning("approval sweep failed: %s: %s", type(exc).__name__, exc)

    return sweep
