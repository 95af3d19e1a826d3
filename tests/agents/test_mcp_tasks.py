"""How long a ``tools/call`` is held, and MCP's Tasks extension
(``io.modelcontextprotocol/tasks``), with the ``mcp`` SDK's own ``Client``
(protocol 2026-07-28) over stdio and streamable HTTP, against real workers.

A client that declares the extension gets a task at once, whose id is the
call's task id; ``tasks/get`` follows the call; ``tasks/cancel`` revokes a
call whose body has not started and says plainly that a started write is not
undone. A client without it is answered within ``tooleffect_mcp_result_wait``
with the call's status and the status tool to ask."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import MCPError, StdioServerParameters
from mcp.client.client import Client
from mcp.client.extension import ClientExtension
from mcp.client.streamable_http import streamable_http_client

from celery_tooleffect import call_task_id
from celery_tooleffect.agents import STATUS_TOOL
from celery_tooleffect.agents.mcp_tasks import TASKS_EXTENSION
from tests.agents.conftest import ROOT, Agents
from tests.agents.tasks_client import (
    TaskHandle,
    Tasks,
    TaskState,
    cancel_task,
    get_task,
    until_status,
)

TRANSPORTS = ["stdio", "http"]


@asynccontextmanager
async def modern(agents: Agents, transport: str, url: str = "",
                 extensions: Sequence[ClientExtension] = ()) -> AsyncIterator[Client]:
    """The SDK's ``Client`` (it negotiates 2026-07-28) with ``tooleffect mcp``."""
    if transport == "stdio":
        command = agents.command("mcp")
        server: Any = StdioServerParameters(command=command[0], args=command[1:],
                                            env={**os.environ, **agents.env}, cwd=str(ROOT))
        async with Client(server, extensions=extensions) as client:
            yield client
        return
    async with httpx2.AsyncClient(headers={"Authorization": "Bearer s3cret"},
                                  timeout=httpx2.Timeout(30, read=120)) as http, \
            Client(streamable_http_client(url, http_client=http),
                   extensions=extensions) as client:
        yield client


def text_of(result: dict[str, Any] | types.CallToolResult) -> str:
    call = (result if isinstance(result, types.CallToolResult)
            else types.CallToolResult.model_validate(result))
    block = call.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


async def until(predicate: Any, timeout: float = 60.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.05)


def keyed(call_id: str, run_id: str = "run-tasks") -> dict[str, Any]:
    return {"idempotencyKey": call_id, "runId": run_id}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_task_follows_the_call_from_queued_to_its_result_or_failure(
        agents: Agents, transport: str) -> None:
    url = agents.http_server() if transport == "http" else ""
    agents.hold("t-1")

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with modern(agents, transport, url, [Tasks()]) as client:
            session = client.session
            assert session.protocol_version == "2026-07-28"
            handle = await session.call_tool("shop.send_invoice", {"key": "t-1", "cents": 5},
                                             meta=keyed("inv-t1"), allow_claimed=True)
            assert isinstance(handle, TaskHandle)
            seen["handle"] = handle
            # No worker yet: the call is queued, its body has not run.
            seen["queued"] = await get_task(session, handle.task_id)
            seen["runs_queued"] = agents.runs("t-1")
            agents.worker()
            await until(lambda: agents.runs("t-1") == 1)
            seen["running"] = await get_task(session, handle.task_id)
            agents.release("t-1")
            seen["done"] = await until_status(session, handle.task_id, "completed")
            failing = await session.call_tool("shop.charge", {"key": "c-t", "cents": 500_000},
                                              meta=keyed("charge-t"), allow_claimed=True)
            assert isinstance(failing, TaskHandle)
            seen["failed"] = await until_status(session, failing.task_id, "completed")
            parked = await session.call_tool("shop.refund", {"key": "r-t", "cents": 5},
                                             meta=keyed("refund-t"), allow_claimed=True)
            assert isinstance(parked, TaskHandle)
            seen["parked"] = await until_status(session, parked.task_id, "input_required")
            # The SDK's Client resolves a task to the call's result by itself.
            seen["resolved"] = await client.call_tool("shop.search", {"query": "usb"})
            with pytest.raises(MCPError) as unknown:
                await get_task(session, "no-such-task")
            seen["unknown"] = unknown.value
        return seen

    seen = anyio.run(scenario)
    handle: TaskHandle = seen["handle"]
    assert handle.task_id == call_task_id("inv-t1", "run-tasks")
    assert handle.status == "working"
    queued: TaskState = seen["queued"]
    assert (queued.status, seen["runs_queued"]) == ("working", 0)
    assert "queued" in (queued.status_message or "")
    running: TaskState = seen["running"]
    assert running.status == "working" and "running" in (running.status_message or "")
    done: TaskState = seen["done"]
    assert done.result is not None and done.result.get("isError") is not True
    assert text_of(done.result) == "INV-t-1-1"
    assert done.result["structuredContent"]["task_id"] == handle.task_id
    assert agents.runs("t-1") == 1
    # A tool's failure is a tool result (isError), naming class, reason and task id.
    failed: TaskState = seen["failed"]
    assert failed.result is not None and failed.result["isError"] is True
    said = text_of(failed.result)
    assert "client_error" in said and "dead-lettered" in said
    assert call_task_id("charge-t", "run-tasks") in said
    assert failed.result["structuredContent"]["status"] == "dead_lettered"
    assert agents.runs("c-t") == 1
    parked: TaskState = seen["parked"]
    assert parked.input_requests == {} and "approval" in (parked.status_message or "")
    assert agents.runs("r-t") == 0
    resolved: types.CallToolResult = seen["resolved"]
    assert not resolved.is_error and resolved.structured_content is not None
    assert resolved.structured_content["result"] == ["usb-0", "usb-1", "usb-2"]
    assert seen["unknown"].code == types.INVALID_PARAMS


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cancel_revokes_a_call_not_started_and_does_not_undo_a_started_write(
        agents: Agents, transport: str) -> None:
    url = agents.http_server() if transport == "http" else ""
    agents.worker(concurrency=1)
    from tests.apps.agent_tools_app import build
    app = build(agents.prefix)
    from celery_tooleffect.testing import wait_for
    wait_for(lambda: app.control.ping(timeout=0.5), what="the worker to answer a ping")
    agents.hold("busy")
    agents.hold("late")

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with modern(agents, transport, url, [Tasks()]) as client:
            session = client.session
            busy = await session.call_tool("shop.send_invoice", {"key": "busy", "cents": 1},
                                           meta=keyed("busy"), allow_claimed=True)
            assert isinstance(busy, TaskHandle)
            await until(lambda: agents.runs("busy") == 1)
            # The only worker process is busy: this call waits, its body not started.
            early = await session.call_tool("shop.send_invoice", {"key": "early", "cents": 1},
                                            meta=keyed("early"), allow_claimed=True)
            assert isinstance(early, TaskHandle)
            seen["early_before"] = await get_task(session, early.task_id)
            seen["early_ack"] = await cancel_task(session, early.task_id)
            agents.release("busy")
            await until_status(session, busy.task_id, "completed")
            seen["early"] = await until_status(session, early.task_id, "cancelled")
            late = await session.call_tool("shop.send_invoice", {"key": "late", "cents": 1},
                                           meta=keyed("late"), allow_claimed=True)
            assert isinstance(late, TaskHandle)
            await until(lambda: agents.runs("late") == 1)
            seen["late_ack"] = await cancel_task(session, late.task_id)
            agents.release("late")
            seen["late"] = await until_status(session, late.task_id, "completed")
            # A call parked for approval: nothing of it ran, and nothing will.
            parked = await session.call_tool("shop.refund", {"key": "r-c", "cents": 5},
                                             meta=keyed("refund-c"), allow_claimed=True)
            assert isinstance(parked, TaskHandle)
            await until_status(session, parked.task_id, "input_required")
            seen["parked_ack"] = await cancel_task(session, parked.task_id)
            seen["parked"] = await until_status(session, parked.task_id, "cancelled")
            # Cancelling a call that ended changes nothing.
            seen["ended_ack"] = await cancel_task(session, late.task_id)
        return seen

    seen = anyio.run(scenario)
    assert seen["early_before"].status == "working"
    ack = (seen["early_ack"].meta or {})["io.modelcontextprotocol/tasks/cancel"]
    assert ack["cancelled"] is True and ack["status"] == "queued"
    assert ack["body_started"] is False
    assert "does not run" in ack["message"]
    early: TaskState = seen["early"]
    assert "nothing of it ran" in (early.status_message or "")
    assert agents.runs("early") == 0
    late_ack = (seen["late_ack"].meta or {})["io.modelcontextprotocol/tasks/cancel"]
    assert late_ack["cancelled"] is False and late_ack["body_started"] is True
    assert "does not undo its write" in late_ack["message"]
    late: TaskState = seen["late"]
    assert late.result is not None and text_of(late.result) == "INV-late-1"
    assert "write is not undone" in (late.status_message or "")
    assert agents.runs("late") == 1
    parked_ack = (seen["parked_ack"].meta or {})["io.modelcontextprotocol/tasks/cancel"]
    assert parked_ack["cancelled"] is True and parked_ack["status"] == "awaiting_approval"
    assert "nothing of it ran" in (seen["parked"].status_message or "")
    assert agents.runs("r-c") == 0
    ended_ack = (seen["ended_ack"].meta or {})["io.modelcontextprotocol/tasks/cancel"]
    assert ended_ack["cancelled"] is False and "nothing to cancel" in ended_ack["message"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_without_the_extension_a_call_is_answered_within_the_mcp_wait(
        agents: Agents, transport: str) -> None:
    agents.env["TE_MCP_RESULT_WAIT"] = "2"
    url = agents.http_server() if transport == "http" else ""

    async def scenario() -> tuple[types.CallToolResult, float, types.CallToolResult]:
        async with modern(agents, transport, url) as client:
            started = time.monotonic()
            answer = await client.call_tool("shop.send_invoice", {"key": "w-1", "cents": 1},
                                            meta=keyed("wait-1"))
            waited = time.monotonic() - started
            with pytest.raises(MCPError) as undeclared:  # tasks/* are for clients that declare it
                await get_task(client.session, call_task_id("wait-1", "run-tasks"))
            assert undeclared.value.code == -32021
            agents.worker()
            task_id = (answer.structured_content or {})["task_id"]
            with anyio.fail_after(60):
                while True:
                    status = await client.call_tool(STATUS_TOOL, {"task_id": task_id})
                    if (status.structured_content or {}).get("status") == "succeeded":
                        break
                    await anyio.sleep(0.2)
        return answer, waited, status

    answer, waited, status = anyio.run(scenario)
    task_id = call_task_id("wait-1", "run-tasks")
    assert not answer.is_error and answer.structured_content is not None
    assert answer.structured_content["status"] == "queued"
    assert text_of(answer) == (f"shop.send_invoice is queued and has not ended yet. Do not "
                               f"call it again: ask {STATUS_TOOL} with task_id {task_id} later.")
    assert 2 <= waited < 20
    assert (status.structured_content or {})["result"] == "INV-w-1-1"
    assert agents.runs("w-1") == 1


def test_the_server_advertises_the_extension_and_the_wait_stays_below_60_s() -> None:
    from celery_tooleffect.agents.mcp_server import ToolServer
    from celery_tooleffect.settings import settings_for
    from tests.apps.agent_tools_app import build

    app = build("te-unit-mcptasks:")
    assert settings_for(app).mcp_result_wait == 50.0
    server = ToolServer(app)
    assert server.result_wait == 50.0 < 60
    assert server.server.extensions == {TASKS_EXTENSION: {}}
    assert ToolServer(app, result_wait=500).result_wait == 60.0  # the caller's own wait
