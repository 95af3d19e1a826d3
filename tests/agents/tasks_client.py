"""A client of MCP's Tasks extension for the tests: the ``mcp`` SDK's own
``Client`` with a ``ClientExtension`` that declares
``io.modelcontextprotocol/tasks`` and claims its ``resultType: "task"``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import anyio
import mcp_types as types
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.session import ClientSession

from celery_tooleffect.agents.mcp_tasks import TASKS_EXTENSION, TaskIdParams


class TaskHandle(types.Result):
    """A task, as ``tools/call`` or ``tasks/get`` answer it."""

    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class TaskState(types.Result):
    """What ``tasks/get`` answers."""

    task_id: str
    status: str
    status_message: str | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    input_requests: dict[str, Any] | None = None


class GetTask(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: TaskIdParams
    name_param: ClassVar[str | None] = "taskId"


class CancelTask(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: TaskIdParams
    name_param: ClassVar[str | None] = "taskId"


async def get_task(session: ClientSession, task_id: str) -> TaskState:
    return await session.send_request(GetTask(params=TaskIdParams(task_id=task_id)), TaskState)


async def cancel_task(session: ClientSession, task_id: str) -> types.Result:
    return await session.send_request(CancelTask(params=TaskIdParams(task_id=task_id)),
                                      types.Result)


async def until_status(session: ClientSession, task_id: str, *wanted: str,
                       timeout: float = 60.0) -> TaskState:
    """Poll ``tasks/get`` until the task's status is one of ``wanted``."""
    with anyio.fail_after(timeout):
        while True:
            state = await get_task(session, task_id)
            if state.status in wanted:
                return state
            await anyio.sleep(0.1)


class Tasks(ClientExtension):
    """Declares the Tasks extension; ``Client.call_tool`` polls a task to its end."""

    identifier = TASKS_EXTENSION

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return (ResultClaim(result_type="task", model=TaskHandle, resolve=self._resolve),)

    @staticmethod
    async def _resolve(handle: TaskHandle, ctx: ClaimContext) -> types.CallToolResult:
        state = await until_status(ctx.session, handle.task_id, "completed", "failed",
                                   "cancelled")
        assert state.result is not None, state
        return types.CallToolResult.model_validate(state.result)
