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

A tool whose ``requires_approval`` names its user (``Approver.USER``,
``Approver.BOTH``) pauses the run the SDK's way: its ``FunctionTool`` gets a
``needs_approval`` that is true while the call waits for its user's decision,
so the run ends with ``result.interruptions``. The app shows each one
(:func:`approval_request`: what the tool's ``approval_view`` shows, and its
digest), records the person's answer with :func:`approve` or :func:`reject`
(the package's record, with its audit event, and the SDK's own
``RunState.approve``/``reject``), then resumes with ``Runner.run(agent,
state)``, in this process or, from ``RunState.to_json()``, another one. The
worker runs the call only with a recorded decision for the arguments shown;
an approval given to the SDK alone gets the call parked, not run. A tool an
operator alone approves is not paused: its call is parked in the worker and
answers that it waits, as before.

The helpers name the run as the call does: give them the ``RunConfig`` the
run resumes with (its trace id, else its group id, is the run id: pass the
same one to both runs when it resumes in another process); a run without
either is identified in its own process only (see :func:`state_run_id`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from .extras import missing_extra

try:
    from agents import FunctionTool, RunConfig, RunContextWrapper, RunState, ToolApprovalItem
    from agents.tool_context import ToolContext
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "openai-agents") from exc

from ..errors import InvalidToolArguments
from ..states import ApprovalState
from ..task import ToolTask
from .approvals import ApprovalAsk, UserApprovals, UserDecision, may_ask_user
from .calls import STATUS_TOOL, CallReport, ToolCaller
from .schema import ToolSpec

__all__ = ["VIA", "approval_request", "approve", "openai_agents_status_tool",
           "openai_agents_tool", "openai_agents_tools", "reject", "state_run_id"]

#: The ``via`` of the decisions recorded here (their audit events).
VIA = "openai-agents"


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

    tool = FunctionTool(
        name=name or spec.function_name, description=spec.description,
        params_json_schema=dict(spec.input_schema), on_invoke_tool=invoke,
        strict_json_schema=takes_strict(spec),
    )
    if may_ask_user(task):
        tool.needs_approval = _waits_for_user(UserApprovals(caller), spec.name)
    # What approval_request finds the task and its app by, from an approval item.
    setattr(tool, _TOOL_ATTRIBUTE, (spec.name, caller))
    return tool


def _waits_for_user(users: UserApprovals, tool: str) -> Any:
    def needs_approval(ctx: RunContextWrapper[Any], params: dict[str, Any],
                       call_id: str) -> bool:
        # True while the call waits for its user: the run ends with an
        # interruption before the call is published. Arguments that do not fit
        # are not paused: the call itself tells the model what is wrong. The
        # SDK gives this no RunConfig, so a run with a trace id is looked up
        # by its own id here: a call decided before may be paused again, and
        # approve()/reject() then follow its record.
        try:
            return users.ask(tool, params, call_id=call_id, run_id=run_id_of(ctx)) is not None
        except InvalidToolArguments:
            return False

    return needs_approval


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
    # Not the current trace: one trace may span many runs (``with trace():``),
    # and each run's call_0 is a call of its own.
    return _configured_run(getattr(ctx, "run_config", None)) or _own_run_id(ctx)


def _configured_run(config: RunConfig | None) -> str | None:
    for value in (getattr(config, "trace_id", None), getattr(config, "group_id", None)):
        if value:
            return str(value)
    return None


def _own_run_id(ctx: RunContextWrapper[Any]) -> str:
    usage = ctx.usage
    own = getattr(usage, _RUN_ATTRIBUTE, None)
    if not isinstance(own, str):
        own = f"run_{uuid.uuid4().hex}"
        setattr(usage, _RUN_ATTRIBUTE, own)  # no await between read and write: one per run
    return own


#: Where a run without a trace id or group id keeps the run id it was given.
_RUN_ATTRIBUTE = "_tooleffect_run_id"
#: The tool (task) name a FunctionTool made here calls, and its caller.
_TOOL_ATTRIBUTE = "_tooleffect_tool"


# -- its user's approval ------------------------------------------------------------


def state_run_id(state: RunState[Any, Any], run_config: RunConfig | None = None) -> str:
    """The run id the calls of the interrupted run ``state`` have when it
    resumes with ``run_config``: its trace id, else its group id (as
    :func:`run_id_of`), else the id this process gave the run, kept on its
    in-memory context, which ``Runner.run(agent, state)`` resumes with. A
    state read from JSON gets a new one: a run without a trace id or group
    id is the same run only in its process."""
    configured = _configured_run(run_config)
    if configured:
        return configured
    context = getattr(state, "_context", None)
    if context is None:
        raise ValueError("this RunState has no context: it is no interrupted run")
    return _own_run_id(context)


def approval_request(state: RunState[Any, Any], item: ToolApprovalItem, app: Any = None, *,
                     run_config: RunConfig | None = None) -> ApprovalAsk:
    """What to show the person who approves the interrupted call ``item`` of
    ``state`` (one of ``result.interruptions``): its tool, task id, what the
    tool's ``approval_view`` shows of its arguments and their digest (pass it
    as ``seen=`` to :func:`approve`). ``app``: the Celery app or its
    :class:`ToolCaller` (default: found from the item's tool). Raises
    ``KeyError`` for an item that is no call of a tool its user approves."""
    return _view(state, item, app, run_config)


def approve(state: RunState[Any, Any], item: ToolApprovalItem, *, by: str, seen: str,
            reason: str = "", app: Any = None, run_config: RunConfig | None = None) -> UserDecision:
    """Record that ``by`` approved the call ``item`` as shown to them (``seen``:
    :attr:`ApprovalAsk.digest`), with its audit event (via ``openai-agents``),
    and approve it in ``state``; resume with ``Runner.run(agent, state)``.

    Refused (the answer is false, says why, and ``state`` is left as it was):
    arguments that show another digest than ``seen``, a tool an operator
    alone approves. A call decided before keeps that decision: ``state``
    follows it (approved, or rejected with its reason)."""
    return _decide(state, item, app, run_config, approve=True, seen=seen, by=by, reason=reason)


def reject(state: RunState[Any, Any], item: ToolApprovalItem, *, by: str, reason: str = "",
           seen: str | None = None, app: Any = None,
           run_config: RunConfig | None = None) -> UserDecision:
    """Record that ``by`` rejected the call ``item`` (``seen``: the digest
    shown, default the item's own), with its audit event, and reject it in
    ``state``: on resume the model is told who rejected it and why, and
    nothing runs. Refused as :func:`approve` is."""
    return _decide(state, item, app, run_config, approve=False, seen=seen, by=by, reason=reason)


def _decide(state: RunState[Any, Any], item: ToolApprovalItem, app: Any,
            run_config: RunConfig | None, *, approve: bool, seen: str | None, by: str,
            reason: str) -> UserDecision:
    ask = _view(state, item, app, run_config)
    users = UserApprovals(_caller_of(item, app))
    decision = users.decide(ask.tool, ask.arguments, call_id=ask.call_id, run_id=ask.run_id,
                            approve=approve, seen=ask.digest if seen is None else seen,
                            by=by, reason=reason, via=VIA)
    if not decision.decided and decision.state is ApprovalState.ABSENT:
        return decision  # refused: nothing recorded, the SDK's state untouched
    # The SDK's state follows the record, also for a call decided before (a
    # run resumed again from an earlier state): it never runs what was
    # rejected, nor asks again about what was approved.
    recorded = users.state(ask.task_id, ask.run_id)
    if recorded in (ApprovalState.APPROVED, ApprovalState.USER_APPROVED):
        state.approve(item)
    elif recorded in (ApprovalState.REJECTED, ApprovalState.EXPIRED):
        state.reject(item, rejection_message=users.rejection(ask))
    return decision


def _view(state: RunState[Any, Any], item: ToolApprovalItem, app: Any,
          run_config: RunConfig | None) -> ApprovalAsk:
    caller = _caller_of(item, app)
    call_id = getattr(item, "call_id", None)
    if not call_id:
        raise ValueError(f"{item.tool_name}: an approval item without a call id")
    arguments = getattr(item, "arguments", None) or "{}"
    ask = UserApprovals(caller).view(_tool_of(item, caller), arguments, call_id=str(call_id),
                                     run_id=state_run_id(state, run_config))
    if ask is None:
        raise KeyError(f"{item.tool_name}: its user approves none of its calls")
    return ask


def _caller_of(item: ToolApprovalItem, app: Any) -> ToolCaller:
    if isinstance(app, ToolCaller):
        return app
    if app is not None:
        return ToolCaller.for_app(app)
    made = _made_here(item)
    if made is None:
        raise ValueError(f"{item.tool_name}: pass the app (or its ToolCaller)")
    return made[1]


def _made_here(item: ToolApprovalItem) -> tuple[str, ToolCaller] | None:
    """The task and caller of the item's FunctionTool, when made here."""
    tools = getattr(getattr(item, "agent", None), "tools", None) or []
    for tool in tools:
        made = getattr(tool, _TOOL_ATTRIBUTE, None)
        if getattr(tool, "name", None) == item.tool_name and made is not None:
            return made  # type: ignore[no-any-return]
    return None


def _tool_of(item: ToolApprovalItem, caller: ToolCaller) -> str:
    """The task the item's FunctionTool calls (by the tool it names, else
    by its function name among the caller's tools)."""
    made = _made_here(item)
    if made is not None:
        return made[0]
    for task in caller.tools():
        if caller.spec(task).function_name == item.tool_name:
            return str(task.name)
    raise KeyError(f"{item.tool_name} is no tool of this app")


def takes_strict(spec: ToolSpec) -> bool:
    """Whether the schema can be sent "strict" (the model's arguments then
    always fit it): only when every argument is required, as strict mode
    makes them all; otherwise an optional argument would become required."""
    properties = set(spec.input_schema.get("properties", {}))
    return properties == set(spec.input_schema.get("required", []))
