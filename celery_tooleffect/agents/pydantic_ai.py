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

pydantic-ai's deferred tools (``requires_approval``, ``ApprovalRequired``)
end the run until the app decides; the package's ``requires_approval`` parks
the published call for an operator. Both combine: a call approved in
pydantic-ai is published then, and the operator's decision still gates the
write.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .extras import missing_extra

try:
    from pydantic_ai import ModelRetry, RunContext, Tool, ToolFailed, ToolReturn
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "pydantic-ai") from exc

from ..states import CallStatus
from ..task import ToolTask
from .calls import STATUS_TOOL, ToolCaller

__all__ = ["pydantic_ai_status_tool", "pydantic_ai_tool", "pydantic_ai_tools"]


def pydantic_ai_tool(task: ToolTask, *, caller: ToolCaller | None = None,
                     name: str | None = None) -> Tool[Any]:
    """The ``Tool`` of ``task`` (named like the task, ``.`` as ``_``, unless
    ``name=`` chooses another)."""
    caller = caller or ToolCaller.for_app(task.app)
    spec = caller.spec(task)

    async def call(ctx: RunContext[Any], **given: Any) -> Any:
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
