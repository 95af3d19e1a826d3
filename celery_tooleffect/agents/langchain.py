"""ToolTasks as LangChain tools, for LangGraph agents (extra ``langchain``).

:func:`langchain_tool` makes a ``StructuredTool`` whose ``args_schema`` is the
tool's own argument model; its call is the tool's task, published with the
model's tool-call id (LangChain's ``InjectedToolCallId``) as the call id and
the graph's ``thread_id`` as the run id (without one: an id of that graph
invocation's own, :func:`thread_id_of`), so that the same tool call is the
same task: a resumed or re-run graph of a thread never runs a write twice,
and another invocation's ``call_0`` is another call. Every ending
the model must hear of (a failure, a dead letter, a rejection, invalid
arguments) is raised as a ``ToolException`` that the tool turns into a
``ToolMessage`` with ``status="error"`` (``handle_tool_error``); the graph
goes on. The call's report is the message's ``artifact``.

A tool whose ``requires_approval`` names the agent's user (``Approver.USER``,
or ``Approver.BOTH``: the user, then an operator) pauses the graph with
LangGraph's ``interrupt()`` before the call is published: the interrupt's
value is the :class:`~celery_tooleffect.agents.approvals.ApprovalAsk` as a
dict (its tool, task id, what its ``approval_view`` shows, that view's digest,
and a ``question``), and the app resumes with
``Command(resume={"approved": bool, "by": str, "reason": str, "digest": str})``
(:class:`ApprovalResume`; ``digest``: the one shown). A resume value of
another shape is refused by LangGraph's own ``response_schema`` check: the
``ainvoke`` raises ``pydantic.ValidationError`` and the interrupt waits to be
answered again. LangGraph re-runs the tool from its top when resumed; the
tool then records the decision (:meth:`UserApprovals.decide`, ``via
"langgraph"``) and publishes the call, which runs once if approved (with
``Approver.BOTH`` it then waits for an operator) and reaches the model as a
rejection (a ``ToolMessage`` with ``status="error"``) if not. A digest other
than the one these arguments show decides nothing and publishes nothing. A
node re-run after its decision was recorded asks nobody again: the call id is
the same task, held by the worker to that decision, and run once. Interrupts
need a checkpointer and a ``thread_id``; a run resumed in another process
needs a persistent checkpointer (an ``InMemorySaver`` lives in one process).

A tool an operator alone approves (``requires_approval=True``) does not
pause the graph: the worker parks the published call, and the model is told
that it awaits a person's approval.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from typing import Annotated, Any

from .extras import missing_extra

try:
    import anyio
    import pydantic
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import InjectedToolCallId, StructuredTool, ToolException
    from langgraph.types import interrupt
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "langchain") from exc

from ..errors import InvalidToolArguments, ToolSchemaError
from ..states import ApprovalState
from ..task import ToolTask
from .approvals import UserApprovals
from .calls import STATUS_TOOL, ToolCaller

__all__ = ["ApprovalResume", "langchain_status_tool", "langchain_tool", "langchain_tools"]

#: The ``via`` of a decision taken through a LangGraph interrupt (its audit event).
VIA = "langgraph"


class ApprovalResume(pydantic.BaseModel):
    """What a LangGraph app resumes a call paused for its user's approval
    with: ``Command(resume={"approved": True, "by": "ana@example.com",
    "reason": "", "digest": interrupt.value["digest"]})``. Validated by
    LangGraph (``interrupt(response_schema=...)``, also sent to clients as a
    JSON schema): a value of another shape raises ``pydantic.ValidationError``
    from the resuming call and leaves the interrupt to be answered again."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, json_schema_extra={
        "description": "The person's decision on a tool call paused for their approval: "
                       "whether they approve it, who they are, why, and the digest of what "
                       "they were shown (the interrupt's 'digest')."})

    approved: pydantic.StrictBool = pydantic.Field(
        description="True: the person approves the call; false: they reject it.")
    by: Annotated[str, pydantic.StringConstraints(strip_whitespace=True, min_length=1)] = \
        pydantic.Field(description="Who decided (recorded and audited as the actor).")
    digest: Annotated[str, pydantic.StringConstraints(min_length=1)] = pydantic.Field(
        description="The digest of what the person was shown: the interrupt's 'digest'.")
    reason: str = pydantic.Field("", description="Why (recorded and audited).")

#: Names LangChain's injection takes for itself.
_RESERVED = frozenset({"tool_call_id", "config", "runtime", "callbacks", "run_manager"})


def langchain_tool(task: ToolTask, *, caller: ToolCaller | None = None,
                   name: str | None = None) -> StructuredTool:
    """The ``StructuredTool`` of ``task`` (async only: ``ainvoke``; named like
    the task, ``.`` as ``_``, unless ``name=`` chooses another)."""
    caller = caller or ToolCaller.for_app(task.app)
    spec = caller.spec(task)
    clash = sorted(_RESERVED & set(spec.input_schema.get("properties", {})))
    if clash:
        raise ToolSchemaError(f"{spec.name}: LangChain reserves the argument name(s) "
                              f"{', '.join(clash)}")
    arguments = pydantic.create_model(
        f"{spec.function_name}_call", __base__=spec.arguments_model,
        tool_call_id=(Annotated[str, InjectedToolCallId], ...),
    )

    users = UserApprovals(caller)

    async def call(tool_call_id: str, config: RunnableConfig, **given: Any) -> tuple[str, Any]:
        run_id = thread_id_of(config)
        if tool_call_id and _in_graph(config):
            await _decided_by_user(users, spec.name, given, call_id=tool_call_id, run_id=run_id)
        report = await caller.call(spec.name, given, call_id=tool_call_id or None,
                                   run_id=run_id)
        if report.is_error:
            raise ToolException(report.message())
        return report.message(), report.to_dict()

    return StructuredTool(
        name=name or spec.function_name, description=spec.description, args_schema=arguments,
        coroutine=call, handle_tool_error=True, response_format="content_and_artifact",
        metadata={"tooleffect_effect": spec.effect.value, "tooleffect_task": spec.name},
    )


def _in_graph(config: RunnableConfig | None) -> bool:
    """Whether the tool runs in a LangGraph node, where ``interrupt()`` can
    pause (the node's scratchpad is in its config). Outside a graph nothing
    can pause: the call is published and the worker parks it until its user
    decides (:class:`UserApprovals`), as for any client that does not ask."""
    return "__pregel_scratchpad" in ((config or {}).get("configurable") or {})


async def _decided_by_user(users: UserApprovals, tool: str, given: dict[str, Any], *,
                           call_id: str, run_id: str) -> None:
    """Pause the graph for the user's decision on this call, if it waits for
    one, and record it when the graph resumes; return once the call may be
    published (the worker holds it to the decision recorded). Raises
    ``ToolException`` when the resume decided nothing (another digest)."""
    try:
        ask = await anyio.to_thread.run_sync(functools.partial(
            users.ask, tool, given, call_id=call_id, run_id=run_id))
    except InvalidToolArguments:
        return  # the call answers them, as for any tool
    if ask is None:  # no decision of its user awaited, or one recorded already
        return
    # Raises GraphInterrupt the first time; the resumed node gets the answer.
    answer = interrupt({**ask.to_dict(), "question": ask.question()},
                       response_schema=ApprovalResume)
    decision = await anyio.to_thread.run_sync(functools.partial(
        users.decide, tool, given, call_id=call_id, run_id=run_id, approve=answer.approved,
        seen=answer.digest, by=answer.by, reason=answer.reason, via=VIA))
    if decision:
        return
    # Refused: decided meanwhile (e.g. by an earlier run of this node) is
    # the worker's to enforce; anything else recorded nothing.
    state = await anyio.to_thread.run_sync(users.state, ask.task_id, run_id)
    if state in (ApprovalState.ABSENT, ApprovalState.PENDING):
        raise ToolException(f"{decision.message}; {tool} was not called.")


def langchain_status_tool(caller: ToolCaller, tools: Iterable[str] | None = None) -> StructuredTool:
    """The status tool: how an earlier call of one of ``tools`` (default: any
    of the app's tools) stands, by its task id; "unknown" for any other id."""
    served = None if tools is None else frozenset(tools)

    async def status(task_id: str, config: RunnableConfig) -> tuple[str, Any]:
        report = await caller.status(task_id, run_id=thread_id_of(config), tools=served)
        return report.message(), report.to_dict()

    return StructuredTool.from_function(
        coroutine=status, name=STATUS_TOOL, response_format="content_and_artifact",
        description=("How an earlier tool call that answered it is waiting or still running "
                     "stands now, by its task_id."),
    )


def langchain_tools(app: Any, patterns: Iterable[str] = ()) -> list[StructuredTool]:
    """Every tool of ``app`` (those matching ``patterns``), and the status tool."""
    caller = ToolCaller.for_app(app)
    served = caller.tools(patterns)
    return [*(langchain_tool(task, caller=caller) for task in served),
            langchain_status_tool(caller, [str(task.name) for task in served])]


def thread_id_of(config: RunnableConfig | None) -> str:
    """The run a tool call belongs to: the graph's ``thread_id``
    (``config["configurable"]``), else the ``run_id`` the invocation's config
    names, else an id of this graph invocation's own.

    The last is bound to the invocation's ``RunControl`` (LangGraph's
    ``Runtime.control``: one per ``invoke``/``ainvoke``/``astream``, shared
    by its steps and subgraphs), so that every tool call of one invocation
    has the same run and a tool-call id repeated by another invocation
    (``call_0``) is another call. A tool called outside a graph has no run
    of its own but the call: each call gets a new run id."""
    configurable = (config or {}).get("configurable") or {}
    runtime = configurable.get("__pregel_runtime")
    given = getattr(getattr(runtime, "execution_info", None), "run_id", None)
    for value in (configurable.get("thread_id"), given):
        if value:
            return str(value)
    control = getattr(runtime, "control", None)
    if control is None:
        return uuid.uuid4().hex
    return _invocations.run_id(control)


class _Invocations:
    """The run ids given to graph invocations without a ``thread_id``, by
    their ``RunControl`` (which takes no attribute and no weak reference):
    held, so that an id is never another object's, for the latest
    :data:`KEPT_INVOCATIONS` invocations that called a tool."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self.ids: OrderedDict[int, tuple[object, str]] = OrderedDict()
        self.lock = threading.Lock()

    def run_id(self, control: object) -> str:
        with self.lock:
            held = self.ids.get(id(control))
            if held is None or held[0] is not control:
                held = (control, f"graph-{uuid.uuid4().hex}")
                self.ids[id(control)] = held
                while len(self.ids) > self.kept:
                    self.ids.popitem(last=False)
            self.ids.move_to_end(id(control))
            return held[1]


#: How many graph invocations' run ids are held (the most recently used).
KEPT_INVOCATIONS = 10_000
_invocations = _Invocations(KEPT_INVOCATIONS)
