"""The agent's user approves a call over MCP (issue 42, item 3): with the
``mcp`` SDK's own clients against ``tooleffect mcp`` and real workers.

A client that declares elicitation is asked before anything is published:
on 2026-07-28 through ``input_required`` (the SDK's ``Client`` answers it with
its elicitation callback and retries), on the handshake versions through
``elicitation/create`` over the open call (``ClientSession``). A client
without elicitation gets the call parked, and an answer that says an
operator can approve it. ``shop.wire`` is approved by its user,
``shop.payout`` by its user then an operator, ``shop.refund`` by an operator
alone."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import ClientSession, MCPError, StdioServerParameters
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client

from celery_tooleffect import Approvals, ApprovalState, AuditLog, call_task_id
from celery_tooleffect.agents import STATUS_TOOL
from celery_tooleffect.agents.mcp_approvals import APPROVAL_INPUT
from tests.agents.conftest import ROOT, Agents
from tests.agents.tasks_client import Tasks
from tests.apps.agent_tools_app import build

pytestmark = pytest.mark.timeout(240)

TRANSPORTS = ["stdio", "http"]
ACCOUNT = "DE89370400440532013000"


class Person:
    """An elicitation callback: what the client's person answers, and what
    they were asked."""

    def __init__(self, action: str = "accept", approve: bool = True, reason: str = "") -> None:
        self.action, self.approve, self.reason = action, approve, reason
        self.asked: list[types.ElicitRequestFormParams] = []

    async def __call__(self, context: Any, params: types.ElicitRequestParams,
                       ) -> types.ElicitResult:
        assert isinstance(params, types.ElicitRequestFormParams), params
        self.asked.append(params)
        if self.action != "accept":
            return types.ElicitResult(action=self.action)  # type: ignore[arg-type]
        content: dict[str, Any] = {"approve": self.approve}
        if self.reason:
            content["reason"] = self.reason
        return types.ElicitResult(action="accept", content=content)


@asynccontextmanager
async def modern(agents: Agents, transport: str, url: str = "", **options: Any,
                 ) -> AsyncIterator[Client]:
    """The SDK's ``Client`` (protocol 2026-07-28); ``options``: its fields
    (``elicitation_callback``, ``extensions``)."""
    if transport == "stdio":
        command = agents.command("mcp")
        server: Any = StdioServerParameters(command=command[0], args=command[1:],
                                            env={**os.environ, **agents.env}, cwd=str(ROOT))
        async with Client(server, **options) as client:
            yield client
        return
    async with httpx2.AsyncClient(headers={"Authorization": "Bearer s3cret"},
                                  timeout=httpx2.Timeout(30, read=120)) as http, \
            Client(streamable_http_client(url, http_client=http), **options) as client:
        yield client


@asynccontextmanager
async def handshake(agents: Agents, transport: str, url: str = "", **options: Any,
                    ) -> AsyncIterator[ClientSession]:
    """The SDK's ``ClientSession`` (the initialize handshake, 2025-11-25)."""
    if transport == "stdio":
        async with agents.stdio(**options) as session:
            yield session
        return
    async with httpx2.AsyncClient(headers={"Authorization": "Bearer s3cret"},
                                  timeout=httpx2.Timeout(30, read=120)) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write, **options) as session:
        await session.initialize()
        yield session


def text(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


def approvals_of(agents: Agents, run: str, task_id: str) -> list[tuple[str, str, str]]:
    """(status, actor, via) of each approval event of the call."""
    return [(e["status"], e.get("actor", ""), e.get("via", ""))
            for e in AuditLog(build(agents.prefix)).events(run)
            if e["task_id"] == task_id and e["phase"] == "approval"]


def operator(agents: Agents, verb: str, task_id: str, *extra: str) -> None:
    done = subprocess.run(agents.command("approvals", verb, task_id, "--by", "olga", *extra),
                          env={**os.environ, **agents.env}, capture_output=True, text=True,
                          timeout=60, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr


async def ended(call: Any, task_id: str, run: str, timeout: float = 60.0) -> dict[str, Any]:
    """Ask the status tool until the call ended: its structured answer."""
    with anyio.fail_after(timeout):
        while True:
            answer = await call(STATUS_TOOL, {"task_id": task_id, "run_id": run})
            status = answer.structured_content
            assert status is not None
            if status["status"] not in ("queued", "running", "awaiting_approval"):
                return dict(status)
            await anyio.sleep(0.2)


def wire(key: str) -> dict[str, Any]:
    return {"key": key, "account": ACCOUNT, "cents": 500}


def keyed(call_id: str, run: str) -> dict[str, Any]:
    return {"idempotencyKey": call_id, "runId": run}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_user_who_approves_through_input_required_gets_the_call_run_once(
    agents: Agents, transport: str,
) -> None:
    agents.worker()
    url = agents.http_server() if transport == "http" else ""
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    person = Person(reason="looks right")

    async def scenario() -> types.CallToolResult:
        async with modern(agents, transport, url, elicitation_callback=person) as client:
            assert client.protocol_version == "2026-07-28"
            return await client.call_tool("shop.wire", wire(key), meta=keyed("c1", run))

    result = anyio.run(scenario)
    assert not result.is_error, text(result)
    assert text(result) == "wired 500 to ****3000 (1)"
    assert agents.runs(key) == 1
    [asked] = person.asked
    # What the package shows: the tool, its approval_view (never the account).
    assert "shop.wire" in asked.message and "****3000" in asked.message
    assert ACCOUNT not in asked.message and "then an operator" not in asked.message
    assert asked.requested_schema["properties"]["approve"]["type"] == "boolean"
    assert asked.requested_schema["required"] == ["approve"]
    actor = "mcp:stdio" if transport == "stdio" else "mcp:static-token"
    assert approvals_of(agents, run, call_task_id("c1", run)) == [("approved", actor, "mcp")]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_without_an_idempotency_key_keeps_its_identity_across_rounds(
    agents: Agents, transport: str,
) -> None:
    """Over HTTP on 2026-07-28 such a request names no run either: both are
    chosen on the first round."""
    agents.worker()
    url = agents.http_server() if transport == "http" else ""
    key = uuid.uuid4().hex[:8]
    person = Person()

    async def scenario() -> types.CallToolResult:
        async with modern(agents, transport, url, elicitation_callback=person) as client:
            return await client.call_tool("shop.wire", wire(key))

    # Had the retry been another call, the decision would be another call's,
    # and this one parked: it ran, once, asked once.
    result = anyio.run(scenario)
    assert not result.is_error, text(result)
    assert text(result) == "wired 500 to ****3000 (1)"
    assert agents.runs(key) == 1 and len(person.asked) == 1


@pytest.mark.parametrize(("transport", "answer"), [
    ("stdio", "decline"), ("stdio", "cancel"), ("stdio", "refuse"), ("http", "decline")])
def test_a_user_who_declines_gets_a_rejection_and_nothing_runs(
    agents: Agents, transport: str, answer: str,
) -> None:
    agents.worker()
    url = agents.http_server() if transport == "http" else ""
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    person = (Person(approve=False, reason="wrong account") if answer == "refuse"
              else Person(action=answer))

    async def scenario() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with modern(agents, transport, url, elicitation_callback=person) as client:
            result = await client.call_tool("shop.wire", wire(key), meta=keyed("c1", run))
            assert result.structured_content is not None
            status = await ended(client.call_tool, result.structured_content["task_id"], run)
            return result, status

    result, status = anyio.run(scenario)
    assert result.is_error
    assert "rejected" in text(result) and "its user" in text(result)
    assert "Nothing of it ran" in text(result)
    assert result.structured_content is not None
    assert result.structured_content["status"] == "rejected"
    assert status["status"] == "rejected"  # the worker ended it so: the status tool says it
    assert agents.runs(key) == 0
    [(decision, _, via)] = approvals_of(agents, run, call_task_id("c1", run))
    assert (decision, via) == ("rejected", "mcp")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_without_elicitation_gets_the_operator_path(
    agents: Agents, transport: str,
) -> None:
    agents.worker()
    url = agents.http_server() if transport == "http" else ""
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"

    async def scenario() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with modern(agents, transport, url) as client:
            parked = await client.call_tool("shop.wire", wire(key), meta=keyed("c1", run))
            assert parked.structured_content is not None
            task_id = parked.structured_content["task_id"]
            assert agents.runs(key) == 0
            await anyio.to_thread.run_sync(lambda: operator(agents, "approve", task_id))
            return parked, await ended(client.call_tool, task_id, run)

    parked, status = anyio.run(scenario)
    assert not parked.is_error
    assert parked.structured_content is not None
    told = text(parked)
    assert parked.structured_content["status"] == "awaiting_approval"
    assert parked.structured_content["approver"] == "user"
    assert "did not ask its user" in told and "without elicitation" in told
    assert f"tooleffect approvals approve {parked.structured_content['task_id']}" in told
    assert status["status"] == "succeeded" and status["result"] == "wired 500 to ****3000 (1)"
    assert agents.runs(key) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_call_approved_by_both_waits_for_an_operator_after_its_user(
    agents: Agents, transport: str,
) -> None:
    agents.worker()
    url = agents.http_server() if transport == "http" else ""
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    person = Person()

    async def scenario() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with modern(agents, transport, url, elicitation_callback=person) as client:
            waiting = await client.call_tool("shop.payout", {"key": key, "cents": 9_000},
                                             meta=keyed("c1", run))
            assert waiting.structured_content is not None
            task_id = waiting.structured_content["task_id"]
            assert agents.runs(key) == 0
            await anyio.to_thread.run_sync(lambda: operator(agents, "approve", task_id))
            return waiting, await ended(client.call_tool, task_id, run)

    waiting, status = anyio.run(scenario)
    [asked] = person.asked
    assert "then an operator" in asked.message
    assert not waiting.is_error
    assert waiting.structured_content is not None
    assert waiting.structured_content["status"] == "awaiting_approval"
    assert waiting.structured_content["approval_state"] == ApprovalState.USER_APPROVED.value
    assert "approved by its user and is waiting for an operator" in text(waiting)
    assert status["status"] == "succeeded"
    assert agents.runs(key) == 1
    actor = "mcp:stdio" if transport == "stdio" else "mcp:static-token"
    decided = approvals_of(agents, run, waiting.structured_content["task_id"])
    assert decided[0] == ("user_approved", actor, "mcp")
    assert decided[-1][:2] == ("approved", "olga")


def test_an_operator_only_tool_never_asks_the_user(agents: Agents) -> None:
    agents.worker()
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    person = Person()

    async def scenario() -> types.CallToolResult:
        async with modern(agents, "stdio", elicitation_callback=person) as client:
            return await client.call_tool("shop.refund", {"key": key, "cents": 700},
                                          meta=keyed("c1", run))

    parked = anyio.run(scenario)
    assert person.asked == []
    assert parked.structured_content is not None
    assert parked.structured_content["status"] == "awaiting_approval"
    assert parked.structured_content["approver"] == "operator"
    assert "waiting for a person's approval" in text(parked)
    assert "its user" not in text(parked)
    assert agents.runs(key) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_handshake_client_is_asked_through_elicitation_create(
    agents: Agents, transport: str,
) -> None:
    agents.worker()
    url = agents.http_server() if transport == "http" else ""
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    person = Person()
    declined = Person(action="decline")
    other = uuid.uuid4().hex[:8]

    async def scenario() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with handshake(agents, transport, url, elicitation_callback=person) as session:
            assert session.protocol_version != "2026-07-28"
            ran = await session.call_tool("shop.wire", wire(key), meta=keyed("c1", run))
        async with handshake(agents, transport, url, elicitation_callback=declined) as session:
            no = await session.call_tool("shop.wire", wire(other), meta=keyed("c2", run))
        return ran, no

    ran, no = anyio.run(scenario)
    assert not ran.is_error and text(ran) == "wired 500 to ****3000 (1)", text(ran)
    assert len(person.asked) == 1 and "****3000" in person.asked[0].message
    assert no.is_error and "rejected" in text(no)
    assert agents.runs(key) == 1 and agents.runs(other) == 0


def test_a_forged_retry_runs_nothing(agents: Agents) -> None:
    """The client drives the rounds itself: a requestState it altered, or
    one sent back with other arguments, is refused before anything is
    decided or published."""
    agents.worker()
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    yes = {APPROVAL_INPUT: types.ElicitResult(action="accept", content={"approve": True})}

    async def scenario() -> list[str]:
        refused: list[str] = []
        async with modern(agents, "stdio", elicitation_callback=Person()) as client:
            first = await client.session.call_tool("shop.wire", wire(key),
                                                   meta=keyed("c1", run),
                                                   allow_input_required=True)
            assert isinstance(first, types.InputRequiredResult)
            assert first.input_requests is not None and APPROVAL_INPUT in first.input_requests
            state = first.request_state
            assert state is not None and run not in state  # sealed, not readable
            forged = state[:-4] + ("AAAA" if not state.endswith("AAAA") else "BBBB")
            for arguments, sent in ((wire(key), forged),
                                    ({**wire(key), "cents": 5_000_000}, state)):
                try:
                    await client.session.call_tool(
                        "shop.wire", arguments, meta=keyed("c1", run), input_responses=yes,
                        request_state=sent, allow_input_required=True)
                except MCPError as exc:
                    refused.append(exc.error.message)
        return refused

    refused = anyio.run(scenario)
    assert refused == ["Invalid or expired requestState"] * 2
    assert Approvals(build(agents.prefix)).get(call_task_id("c1", run)) is None
    assert agents.runs(key) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tasks_client_with_elicitation_is_asked_before_its_task(
    agents: Agents, transport: str,
) -> None:
    agents.worker()
    url = agents.http_server() if transport == "http" else ""
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    person = Person()

    async def scenario() -> types.CallToolResult:
        async with modern(agents, transport, url, elicitation_callback=person,
                          extensions=[Tasks()]) as client:
            return await client.call_tool("shop.wire", wire(key), meta=keyed("c1", run))

    result = anyio.run(scenario)
    assert not result.is_error, text(result)
    assert text(result) == "wired 500 to ****3000 (1)"
    assert len(person.asked) == 1 and agents.runs(key) == 1


def test_a_tasks_client_approving_a_call_of_both_gets_a_task_that_waits_for_an_operator(
    agents: Agents,
) -> None:
    agents.worker()
    app = build(agents.prefix)
    key, run = uuid.uuid4().hex[:8], f"run-{uuid.uuid4().hex[:6]}"
    task_id = call_task_id("c1", run)
    person = Person()

    def parked() -> bool:
        record = Approvals(app).get(task_id)
        return (record is not None and record.message is not None
                and record.state is ApprovalState.USER_APPROVED)

    async def scenario() -> types.CallToolResult:
        result: list[types.CallToolResult] = []
        async with modern(agents, "stdio", elicitation_callback=person,
                          extensions=[Tasks()]) as client:
            async def call() -> None:
                result.append(await client.call_tool(
                    "shop.payout", {"key": key, "cents": 9_000}, meta=keyed("c1", run)))

            async with anyio.create_task_group() as group:
                group.start_soon(call)
                with anyio.fail_after(60):
                    while not parked():
                        await anyio.sleep(0.1)
                assert agents.runs(key) == 0 and not result
                await anyio.to_thread.run_sync(lambda: operator(agents, "approve", task_id))
        return result[0]

    result = anyio.run(scenario)
    assert len(person.asked) == 1 and "then an operator" in person.asked[0].message
    assert not result.is_error, text(result)
    assert agents.runs(key) == 1
