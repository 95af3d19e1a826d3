"""ToolTasks as pydantic-ai tools (extra ``pydantic-ai``).

:func:`pydantic_ai_tool` makes a ``Tool`` with the tool's input schema; its
call is the tool's task, published with ``RunContext.tool_call_id`` as the
call id and the conversation (``RunContext.conversation_id``, which stays the
same when a run resumes after deferred tools; else ``run_id``) as the run id,
so that the same tool call is the same task. Arguments that do not fit raise
``ModelRetry`` (the model can correct them); every other error ending (a
failure, a dead letter, a rejection) raises ``ToolFailed``, which the model
sees as a failed call that is not to be retried; the run goes on. A success
returns the tool's result (a result longer than
``tooleffect_agent_max_result_bytes``: its cut text with a note), with the
call's report as the ``ToolReturn``'s metadata (not sent to the model).

A tool whose ``requires_approval`` names its user (``Approver.USER``,
``Approver.BOTH``) pauses the run with pydantic-ai's deferred tools: while
the call waits for its user's decision, the tool raises ``ApprovalRequired``
(its metadata: :meth:`ApprovalAsk.to_dict`) and the run's output is
``DeferredToolRequests``. **The agent must be built with
``output_type=[..., DeferredToolRequests]``** (pydantic-ai refuses a
deferred call otherwise). The app shows each of ``requests.approvals``
(:func:`approval_request`), records each answer with :func:`approve` or
:func:`reject` into a ``DeferredToolResults`` (``ToolApproved()``, or
``ToolDenied`` with who rejected it and why), and resumes with
``agent.run(message_history=..., deferred_tool_results=results)``, in this
process or another one: the conversation id, kept on the messages, keeps
the call's identity (:func:`conversation_of`).

A call approved in pydantic-ai without :func:`approve` (the app built
``DeferredToolResults`` itself) has no decision of its user on record: the
tool does not publish it (the worker would park it) and tells the model it
did not run because the app must record the decision with :func:`approve`.
A tool an operator alone approves is not deferred: its call is parked in the
worker and answers that it waits, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .extras import missing_extra

try:
    from pydantic_ai import (
        ApprovalRequired,
        DeferredToolResults,
        ModelRetry,
        RunContext,
        Tool,
        ToolApproved,
        ToolDenied,
        ToolFailed,
        ToolReturn,
    )
    from pydantic_ai.messages import ModelMessage, ToolCallPart
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "pydantic-ai") from exc

from ..errors import InvalidToolArguments
from ..states import ApprovalState, CallStatus
from ..task import ToolTask
from .approvals import ApprovalAsk, UserApprovals, UserDecision, may_ask_user
from .calls import STATUS_TOOL, ToolCaller

__all__ = ["VIA", "approval_request", "approve", "conversation_of", "pydantic_ai_status_tool",
           "pydantic_ai_tool", "pydantic_ai_tools", "reject"]

#: The ``via`` of the decisions recorded here (their audit events).
VIA = "pydantic-ai"


def pydantic_ai_tool(task: ToolTask, *, caller: ToolCaller | None = None,
                     name: str | None = None) -> Tool[Any]:
    """The ``Tool`` of ``task`` (named like the task, ``.`` as ``_``, unless
    ``name=`` chooses another)."""
    caller = caller or ToolCaller.for_app(task.app)
    spec = caller.spec(task)

    users = UserApprovals(caller) if may_ask_user(task) else None

    async def call(ctx: RunContext[Any], **given: Any) -> Any:
        if users is not None and ctx.tool_call_id:
            _wait_for_user(users, spec.name, given, ctx)
        report = await caller.call(spec.name, given, call_id=ctx.tool_call_id or None,
                                   run_id=run_id_of(ctx))
        if report.status is CallStatus.REFUSED and report.invalid:
            raise ModelRetry(report.message())
        if report.is_error:
            raise ToolFailed(report.message())
        if report.status is not CallStatus.SUCCEEDED or report.result_cut:
            return ToolReturn(report.message(), metadata=report.to_dict())
        return ToolReturn(report.result, metadata=report.to_dict())

    tool: Tool[Any] = Tool.from_schema(call, name=name or spec.function_name,
                                       description=spec.description,
                                       json_schema=spec.input_schema, takes_ctx=True)
    return tool


def _wait_for_user(users: UserApprovals, tool: str, given: dict[str, Any],
                   ctx: RunContext[Any]) -> None:
    """Raise ``ApprovalRequired`` while the call waits for its user (the run
    ends with ``DeferredToolRequests``); refuse a call approved in pydantic-ai
    whose decision nobody recorded. Return when the call may be published."""
    try:
        ask = users.ask(tool, given, call_id=str(ctx.tool_call_id),
                        run_id=run_id_of(ctx) or "")
    except InvalidToolArguments:
        return  # the call itself tells the model what is wrong
    if ask is None:
        return  # decided (the worker holds the call to it), or no user decides it
    if not ctx.tool_call_approved:
        raise ApprovalRequired(metadata=ask.to_dict())
    # Approved in pydantic-ai, but no decision of its user is on record: the
    # worker would park the call. Say so rather than wait for nobody.
    raise ToolFailed(
        f"{ask.tool} did not run (task_id {ask.task_id}): it was approved in the agent run "
        "but its user's decision was not recorded. The app records it with "
        "celery_tooleffect.agents.pydantic_ai.approve() when it builds the "
        "DeferredToolResults; then the run resumes. Do not call it again.")


def pydantic_ai_status_tool(caller: ToolCaller, tools: Iterable[str] | None = None) -> Tool[Any]:
    """The status tool: how an earlier call of one of ``tools`` (default: any
    of the app's tools) stands, by its task id; "unknown" for any other id."""
    served = None if tools is None else frozenset(tools)

    async def status(ctx: RunContext[Any], task_id: str) -> Any:
        report = await caller.status(task_id, run_id=run_id_of(ctx) or "", tools=served)
        return report.to_dict()

    return Tool(status, name=STATUS_TOOL, takes_ctx=True,
                description=("How an earlier tool call that answered it is waiting or still "
                             "running stands now, by its task_id."))


def pydantic_ai_tools(app: Any, patterns: Iterable[str] = ()) -> list[Tool[Any]]:
    """Every tool of ``app`` (those matching ``patterns``), and the status tool."""
    caller = ToolCaller.for_app(app)
    served = caller.tools(patterns)
    return [*(pydantic_ai_tool(task, caller=caller) for task in served),
            pydantic_ai_status_tool(caller, [str(task.name) for task in served])]


def run_id_of(ctx: RunContext[Any]) -> str | None:
    """The conversation a call belongs to, else the run. pydantic-ai gives
    every ``Agent.run`` a ``conversation_id``: the one passed, else the latest
    on ``message_history`` (a resumed run keeps it), else a fresh UUID7; and
    a ``run_id``, fresh unless passed. A run never lacks one of its own."""
    for value in (getattr(ctx, "conversation_id", None), getattr(ctx, "run_id", None)):
        if value:
            return str(value)
    return None


# -- its user's approval ------------------------------------------------------------


def conversation_of(messages: Sequence[ModelMessage]) -> str:
    """The conversation id of ``messages`` (the latest one on them): the run
    id of their tool calls, which a run resumed with them keeps."""
    for message in reversed(messages):
        conversation = getattr(message, "conversation_id", None)
        if conversation:
            return str(conversation)
    raise ValueError("no conversation id on these messages")


def approval_request(part: ToolCallPart, app: Any, *, conversation_id: str) -> ApprovalAsk:
    """What to show the person who approves the deferred call ``part`` (one of
    ``DeferredToolRequests.approvals``) of the conversation ``conversation_id``
    (``result.conversation_id``, or :func:`conversation_of` the messages):
    its tool, task id, what the tool's ``approval_view`` shows of its
    arguments and their digest (pass it as ``seen=`` to :func:`approve`).
    ``app``: the Celery app or its :class:`ToolCaller`. Raises ``KeyError``
    for a call of a tool its user does not approve."""
    caller = _caller(app)
    ask = UserApprovals(caller).view(_tool_of(part, caller), part.args_as_dict(),
                                     call_id=part.tool_call_id, run_id=conversation_id)
    if ask is None:
        raise KeyError(f"{part.tool_name}: its user approves none of its calls")
    return ask


def approve(results: DeferredToolResults, part: ToolCallPart, app: Any, *,
            conversation_id: str, by: str, seen: str, reason: str = "") -> UserDecision:
    """Record that ``by`` approved the call ``part`` as shown to them
    (``seen``: :attr:`ApprovalAsk.digest`), with its audit event (via
    ``pydantic-ai``), and put ``ToolApproved()`` for it in ``results``.

    Refused (the answer is false and says why; ``results`` gets nothing for
    the call): arguments that show another digest than ``seen``, a tool an
    operator alone approves. A call decided before keeps that decision:
    ``results`` follows it (approved, or denied with its reason)."""
    return _decide(results, part, app, conversation_id, approve=True, seen=seen, by=by,
                   reason=reason)


def reject(results: DeferredToolResults, part: ToolCallPart, app: Any, *,
           conversation_id: str, by: str, reason: str = "",
           seen: str | None = None) -> UserDecision:
    """Record that ``by`` rejected the call ``part`` (``seen``: the digest
    shown, default the call's own), with its audit event, and put
    ``ToolDenied`` for it in ``results``: the model is told who rejected it
    and why, and nothing runs. Refused as :func:`approve` is."""
    return _decide(results, part, app, conversation_id, approve=False, seen=seen, by=by,
                   reason=reason)


def _decide(results: DeferredToolResults, part: ToolCallPart, app: Any, conversation_id: str,
            *, approve: bool, seen: str | None, by: str, reason: str) -> UserDecision:
    ask = approval_request(part, app, conversation_id=conversation_id)
    users = UserApprovals(_caller(app))
    decision = users.decide(ask.tool, ask.arguments, call_id=ask.call_id, run_id=ask.run_id,
                            approve=approve, seen=ask.digest if seen is None else seen,
                            by=by, reason=reason, via=VIA)
    if not decision.decided and decision.state is ApprovalState.ABSENT:
        return decision  # refused: nothing recorded, nothing put in results
    # The results follow the record, also for a call decided before.
    recorded = users.state(ask.task_id, ask.run_id)
    if recorded in (ApprovalState.APPROVED, ApprovalState.USER_APPROVED):
        results.approvals[part.tool_call_id] = ToolApproved()
    elif recorded in (ApprovalState.REJECTED, ApprovalState.EXPIRED):
        results.approvals[part.tool_call_id] = ToolDenied(users.rejection(ask))
    else:
        return decision
    results.answered_by[part.tool_call_id] = by
    return decision


def _caller(app: Any) -> ToolCaller:
    return app if isinstance(app, ToolCaller) else ToolCaller.for_app(app)


def _tool_of(part: ToolCallPart, caller: ToolCaller) -> str:
    """The task a deferred call calls: by its function name (or task name)."""
    for task in caller.tools():
        if part.tool_name in (caller.spec(task).function_name, str(task.name)):
            return str(task.name)
    raise KeyError(f"{part.tool_name} is no tool of this app")
