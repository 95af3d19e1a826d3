"""MCP's Tasks extension (``io.modelcontextprotocol/tasks``, protocol
2026-07-28) for the MCP server, on the ``mcp`` SDK's extension interface
(:class:`mcp.server.extension.Extension`, SEP-2133).

The SDK (2.3.0) carries the extension interface (new request methods, a
``tools/call`` interceptor, the capability advertisement, delivery of an
extension ``resultType``) but not the Tasks extension itself: this module is
the extension, with the shapes of the extension's schema.

A ``tools/call`` from a client that declares the extension on the request
(``_meta`` ``io.modelcontextprotocol/clientCapabilities``, protocol
2026-07-28) is published and answered at once with a task (``resultType:
"task"``) whose ``taskId`` is the call's Celery task id: the call's identity
(``docs/identity.md``), durable before the answer leaves (its publish-time
claim names its tool). ``tasks/get`` answers how the call stands, mapped from
its :class:`~celery_tooleffect.states.CallStatus`:

- queued, running: ``working``;
- parked for a person's approval: ``input_required`` (no request of the
  client: the approver decides where approvals are decided). A call its
  user approves is asked of a client with elicitation before its task
  exists (``input_required`` on the ``tools/call`` itself,
  :mod:`.mcp_approvals`): its task is created on the retry that carries
  the answer;
- succeeded: ``completed``, with the tool's result;
- failed, dead-lettered, rejected, revoked by an operator: ``completed`` with
  an ``isError`` result naming the failure class, the dead-letter reason and
  the task id, as the call's own answer says. The extension keeps ``failed``
  for JSON-RPC errors ("MUST NOT be used for non-JSON-RPC errors"), and a
  tool's failure is a tool result;
- cancelled through ``tasks/cancel`` before its body started: ``cancelled``.

``tasks/cancel`` revokes a call that has not started (Celery's revoke; a
call parked for approval is rejected, so nothing of it runs). A call whose
body started is not stopped: its write is not undone. Its task then goes on
to its end, and its status message says that the cancel came too late.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

import anyio
import mcp_types as types
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver.server import require_client_extension
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import Field

from ..actions.approving import decide_approval
from ..states import ApprovalState, CallStatus
from ..store.runtime import runtime_for
from .calls import CallReport, ToolCaller

if TYPE_CHECKING:
    from celery import Celery

#: The extension's identifier.
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"

#: How often a client is asked to poll (``pollIntervalMs``).
POLL_INTERVAL_MS = 1000

#: The most tasks a server process remembers the creation time and run of
#: (the oldest are forgotten first: then known from the call's records).
MAX_RECORDS = 100_000

TaskStatus = Literal["working", "input_required", "completed", "failed", "cancelled"]


class TaskIdParams(types.RequestParams):
    """The params of ``tasks/get`` and ``tasks/cancel``."""

    task_id: str


class UpdateTaskParams(types.RequestParams):
    """The params of ``tasks/update``."""

    task_id: str
    input_responses: dict[str, Any] = Field(default_factory=dict)


class TaskFields(types.Result):
    """The extension's ``Task``, with the payload of its status inlined
    (``DetailedTask``)."""

    task_id: str
    status: TaskStatus
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None = None
    poll_interval_ms: int | None = POLL_INTERVAL_MS
    #: completed: the ``CallToolResult`` of the call.
    result: dict[str, Any] | None = None
    #: failed: the JSON-RPC error.
    error: dict[str, Any] | None = None
    #: input_required: the requests the client is asked to answer.
    input_requests: dict[str, Any] | None = None


class CreateTaskResult(TaskFields):
    """A ``tools/call`` answered with a task (``resultType: "task"``)."""

    result_type: Literal["task"] = "task"


class GetTaskResult(TaskFields):
    """The answer of ``tasks/get``."""

    result_type: Literal["complete"] = "complete"


class AckResult(types.Result):
    """The empty acknowledgement of ``tasks/update`` and ``tasks/cancel``."""

    result_type: Literal["complete"] = "complete"


@dataclass
class TaskRecord:
    """What this server process knows of a task it created, beyond the call's
    own records: when, in which run, and whether a cancel was asked."""

    tool: str
    run_id: str
    created_at: float
    updated_at: float
    last_status: str = ""
    #: The cancel was asked before the body started (and Celery was told).
    cancelled: bool = False
    #: The cancel was asked after the body started: the write is not undone.
    cancel_too_late: bool = False


def _iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, timezone.utc).isoformat().replace("+00:00", "Z")


def declares_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Whether the request's client declared the Tasks extension, on a
    protocol that can carry a task result (2026-07-28: the SDK delivers an
    extension ``resultType`` on modern connections only)."""
    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    capabilities = ctx.session.client_capabilities
    declared = capabilities.extensions if capabilities is not None else None
    return bool(declared) and TASKS_EXTENSION in (declared or {})


def task_status(report: CallReport, record: TaskRecord | None) -> TaskStatus:
    """The task status of a call that stands as ``report``."""
    status = report.status
    if status in (CallStatus.QUEUED, CallStatus.RUNNING):
        return "working"
    if status is CallStatus.AWAITING_APPROVAL:
        return "input_required"
    if (record is not None and record.cancelled
            and status in (CallStatus.REVOKED, CallStatus.REJECTED)):
        return "cancelled"
    return "completed"


class ToolTasks(Extension):
    """The Tasks extension over the server's tool calls.

    ``start`` publishes a call and answers its task id (or a ``CallReport``
    when nothing was published: refused arguments, an id of another call);
    ``answer`` turns a report into the ``CallToolResult`` the call's client
    would have been given without the extension.
    """

    identifier = TASKS_EXTENSION

    def __init__(self, app: Celery, caller: ToolCaller, tools: Mapping[str, Any], *,
                 start: Callable[[ServerRequestContext[Any, Any], types.CallToolRequestParams],
                                 Awaitable[types.CallToolResult | types.InputRequiredResult
                                           | tuple[str, str]]],
                 answer: Callable[[CallReport], types.CallToolResult]) -> None:
        self.app = app
        self.caller = caller
        self.served = tools
        self.start = start
        self.answer = answer
        self.records: OrderedDict[str, TaskRecord] = OrderedDict()

    def methods(self) -> Sequence[MethodBinding]:
        return (MethodBinding("tasks/get", TaskIdParams, self._get),
                MethodBinding("tasks/update", UpdateTaskParams, self._update),
                MethodBinding("tasks/cancel", TaskIdParams, self._cancel))

    async def intercept_tool_call(self, params: types.CallToolRequestParams,
                                  ctx: ServerRequestContext[Any, Any],
                                  call_next: CallNext) -> HandlerResult:
        if params.name not in self.served or not declares_tasks(ctx):
            return await call_next(ctx)
        started = await self.start(ctx, params)
        if not isinstance(started, tuple):  # nothing was published (or the user is asked)
            return started
        task_id, run_id = started
        record = self._remember(task_id, params.name, run_id)
        report = await anyio.to_thread.run_sync(
            self.caller.observe, task_id, params.name, run_id, "", 0.0)
        fields = self._fields(report, record)
        # The seed state asks nothing: an ``inputRequests`` on a tools/call
        # result would read as the core protocol's own (MRTR), not the task's.
        fields.pop("input_requests", None)
        return CreateTaskResult(**fields)

    # -- the methods ------------------------------------------------------------

    async def _get(self, ctx: ServerRequestContext[Any, Any],
                   params: TaskIdParams) -> GetTaskResult:
        require_client_extension(ctx, TASKS_EXTENSION)
        report, record = await self._find(params.task_id)
        return GetTaskResult(**self._fields(report, record))

    async def _update(self, ctx: ServerRequestContext[Any, Any],
                      params: UpdateTaskParams) -> AckResult:
        # No task of this server asks the client anything (an approval is the
        # approver's): every response answers no outstanding key, and is ignored.
        require_client_extension(ctx, TASKS_EXTENSION)
        await self._find(params.task_id)
        return AckResult()

    async def _cancel(self, ctx: ServerRequestContext[Any, Any],
                      params: TaskIdParams) -> AckResult:
        require_client_extension(ctx, TASKS_EXTENSION)
        report, record = await self._find(params.task_id)
        said = await anyio.to_thread.run_sync(self.cancel, report, record)
        return AckResult(_meta={"io.modelcontextprotocol/tasks/cancel": said})

    # -- reading and cancelling ---------------------------------------------------

    async def _find(self, task_id: str) -> tuple[CallReport, TaskRecord]:
        """How the task's call stands, and this server's record of it; the
        JSON-RPC error ``-32602`` for an id that is no call of a served tool."""
        record = self.records.get(task_id)
        report = await anyio.to_thread.run_sync(
            self.caller.answer_status, task_id, record.run_id if record else "", self.served)
        if report.status is CallStatus.UNKNOWN:
            raise MCPError(code=types.INVALID_PARAMS,
                           message=f"Failed to retrieve task: no call of the tools served "
                                   f"here has task id {task_id}")
        if record is None:  # a task of another server process: known from now on
            record = self._remember(task_id, report.tool, report.run_id)
        return report, record

    def _remember(self, task_id: str, tool: str, run_id: str) -> TaskRecord:
        record = self.records.get(task_id)
        if record is None:
            now = time.time()
            record = self.records[task_id] = TaskRecord(tool, run_id, now, now)
            while len(self.records) > MAX_RECORDS:
                self.records.popitem(last=False)
        return record

    def cancel(self, report: CallReport, record: TaskRecord) -> dict[str, Any]:
        """Cancel the call if its body has not started (blocking); what was
        done, as the ``_meta`` of the acknowledgement says it."""
        tool, task_id = report.tool, report.task_id
        if report.status is CallStatus.QUEUED:
            record.cancelled = True
            self.app.control.revoke(task_id)
            message = (f"{tool} (task_id {task_id}) was queued, its body had not started: "
                       "it is revoked and does not run.")
        elif report.status is CallStatus.AWAITING_APPROVAL:
            approval = runtime_for(self.app).approvals.get(task_id)
            if approval is not None and approval.state is ApprovalState.PENDING:
                record.cancelled = True
                decide_approval(self.app, approval, ApprovalState.REJECTED, by="mcp-client",
                                reason="cancelled by the MCP client (tasks/cancel)",
                                via="mcp")
            message = (f"{tool} (task_id {task_id}) was waiting for approval, nothing of it "
                       "had run: it is cancelled and does not run.")
        elif report.status is CallStatus.RUNNING:
            record.cancel_too_late = True
            message = (f"{tool} (task_id {task_id}) had started: a cancel does not stop it and "
                       "does not undo its write; its body ran or is running, and the task "
                       "reports how it ends.")
        else:
            message = (f"{tool} (task_id {task_id}) had already ended "
                       f"({report.status.value}): nothing to cancel.")
        record.updated_at = time.time()
        return {"task_id": task_id, "status": report.status.value,
                "body_started": (True if report.status is CallStatus.RUNNING
                                 else None if report.status.ended else False),
                "cancelled": record.cancelled, "message": message}

    def _fields(self, report: CallReport, record: TaskRecord) -> dict[str, Any]:
        status = task_status(report, record)
        if status != record.last_status:
            record.last_status = status
            record.updated_at = max(record.updated_at, time.time())
        fields: dict[str, Any] = {
            "task_id": report.task_id, "status": status,
            "created_at": _iso(record.created_at), "last_updated_at": _iso(record.updated_at),
            "status_message": self._message(report, record, status)}
        if status == "completed":
            fields["result"] = self.answer(report).model_dump(
                by_alias=True, mode="json", exclude_none=True)
        elif status == "input_required":
            fields["input_requests"] = {}
        return fields

    @staticmethod
    def _message(report: CallReport, record: TaskRecord, status: TaskStatus) -> str:
        tool, task_id = report.tool, report.task_id
        if status == "cancelled":
            return (f"{tool} (task_id {task_id}) was cancelled before its body started: "
                    "nothing of it ran.")
        if status == "input_required":
            return (f"{tool} (task_id {task_id}) is waiting for a person's approval; nothing "
                    "of it has run. The approver decides where approvals are decided; this "
                    "task asks the client nothing.")
        if status == "working":
            told = (f"{tool} (task_id {task_id}) is {report.status.value}; poll tasks/get "
                    "for how it ends.")
        else:
            told = f"{tool} (task_id {task_id}) ended: {report.status.value}."
        if record.cancel_too_late:
            told += (" A cancel was asked after its body started: it was not stopped and its "
                     "write is not undone.")
        return told


__all__ = ["TASKS_EXTENSION", "CreateTaskResult", "GetTaskResult", "TaskIdParams",
           "ToolTasks", "UpdateTaskParams", "declares_tasks", "task_status"]
