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

LangGraph's ``interrupt()`` stops a graph for a person *before* a node runs,
and re-runs the whole node when resumed; the package's ``requires_approval``
parks the published call for an operator. Both combine: a resumed node calls
the tool again with the same tool-call id, which is the same call.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from typing import Annotated, Any

from .extras import missing_extra

try:
    import pydantic
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import InjectedToolCallId, StructuredTool, ToolException
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "langchain") from exc

from ..errors import ToolSchemaError
from ..task import ToolTask
from .calls import STATUS_TOOL, ToolCaller

__all__ = ["langchain_status_tool", "langchain_tool", "langchain_tools"]

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

    async def call(tool_call_id: str, config: RunnableConfig, **given: Any) -> tuple[str, Any]:
        report = await caller.call(spec.name, given, call_id=tool_call_id or None,
                                   run_id=thread_id_of(config))
        if report.is_error:
            raise ToolException(report.message())
        return report.message(), report.to_dict()

    return StructuredTool(
        name=name or spec.function_name, description=spec.description, args_schema=arguments,
        coroutine=call, handle_tool_error=True, response_format="content_and_artifact",
        metadata={"tooleffect_effect": spec.effect.value, "tooleffect_task": spec.name},
    )


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
