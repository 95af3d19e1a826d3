"""ToolTasks as OpenAI Agents SDK tools (extra ``openai-agents``).

:func:`openai_agents_tool` makes a ``FunctionTool`` with the tool's input
schema; its call is the tool's task, published with the model's
``ToolContext.tool_call_id`` as the call id and the run's trace id
(``RunConfig.trace_id``, else ``group_id``, else an id of that
``Runner.run``'s own: :func:`run_id_of`) as the run id, so that the same
tool call is the same task: a re-run after a crash with the same trace id
never runs a write twice, and another run's ``call_0`` is another call.
The call awaits the task without blocking the event loop. Every ending the
model must hear of (a failure, a dead letter, a rejection, invalid arguments)
is returned to it as the tool's output, which the SDK sends back for that
call id; the run goes on. A call parked for approval past
``tooleffect_agent_approval_wait`` answers that it waits, and
:func:`openai_agents_tools` adds the status tool to ask about it later.

The SDK's own ``needs_approval`` asks the *run's* user before the call is
published; the package's ``requires_approval`` asks an operator after it is,
in the worker. A tool may have both: the first decides whether the agent may
ask, the second whether the write may run.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from .extras import missing_extra

try:
    from agents import FunctionTool, RunContextWrapper
    from agents.tool_context import ToolContext
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "openai-agents") from exc

from ..task import ToolTask
from .calls import STATUS_TOOL, CallReport, ToolCaller
from .schema import ToolSpec

__all__ = ["openai_agents_status_tool", "openai_agents_tool", "openai_agents_tools"]


def openai_agents_tool(task: ToolTask, *, caller: ToolCaller | None = None,
                       name: str | None = None) -> FunctionTool:
    """The ``FunctionTool`` of ``task`` (named like the task, ``.`` as ``_``:
    the Responses API's function names take no dots; ``name=`` chooses another)."""
    caller = caller or ToolCaller.for_app(task.app)
    spec = caller.spec(task)

    async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
        report = await caller.call(spec.name, arguments, call_id=ctx.tool_call_id or None,
                                   run_id=run_id_of(ctx))
        return report.message()

    return FunctionTool(
        name=name or spec.function_name, description=spec.description,
        params_json_schema=dict(spec.input_schema), on_invoke_tool=invoke,
        strict_json_schema=takes_strict(spec),
    )


def openai_agents_status_tool(caller: ToolCaller,
                              tools: Iterable[str] | None = None) -> FunctionTool:
    """The status tool: how an earlier call of one of ``tools`` (default: any
    of the app's tools) stands, by its task id; "unknown" for any other id."""
    served = None if tools is None else frozenset(tools)

    async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
        task_id = str(json.loads(arguments or "{}").get("task_id") or "")
        report: CallReport = await caller.status(task_id, run_id=run_id_of(ctx),
                                                 tools=served)
        return json.dumps(report.to_dict())

    return FunctionTool(
        name=STATUS_TOOL, description=("How an earlier tool call that answered it is waiting "
                                       "or still running stands now, by its task_id."),
        params_json_schema={"type": "object", "properties": {"task_id": {"type": "string"}},
                            "required": ["task_id"], "additionalProperties": False},
        on_invoke_tool=invoke,
    )


def openai_agents_tools(app: Any, patterns: Iterable[str] = ()) -> list[FunctionTool]:
    """Every tool of ``app`` (those matching ``patterns``), and the status tool."""
    caller = ToolCaller.for_app(app)
    served = caller.tools(patterns)
    return [*(openai_agents_tool(task, caller=caller) for task in served),
            openai_agents_status_tool(caller, [str(task.name) for task in served])]


def run_id_of(ctx: RunContextWrapper[Any]) -> str:
    """The run a tool call belongs to: the run's trace id, else its group id
    (``RunConfig``), else an id of this ``Runner.run`` of its own.

    The last is kept on the run's ``Usage`` object, which the SDK makes once
    per ``RunContextWrapper`` (per ``Runner.run``, and kept when an
    interrupted run resumes from its in-memory ``RunState``) and shares with
    every tool call of the run: a tool-call id repeated by another run, as
    servers that number calls per response (``call_0``) do, is another call."""
    config = getattr(ctx, "run_config", None)
    for value in (getattr(config, "trace_id", None), getattr(config, "group_id", None)):
        if value:
            return str(value)
    usage = ctx.usage
    own = getattr(usage, _RUN_ATTRIBUTE, None)
    if not isinstance(own, str):
        own = f"run_{uuid.uuid4().hex}"
        setattr(usage, _RUN_ATTRIBUTE, own)  # no await between read and write: one per run
    return own


#: Where a run without a trace id or group id keeps the run id it was given.
_RUN_ATTRIBUTE = "_tooleffect_run_id"


def takes_strict(spec: ToolSpec) -> bool:
    """Whether the schema can be sent "strict" (the model's arguments then
    always fit it): only when every argument is required, as strict mode
    makes them all; otherwise an optional argument would become required."""
    properties = set(spec.input_schema.get("properties", {}))
    return properties == set(spec.input_schema.get("required", []))
