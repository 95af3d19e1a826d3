"""The MCP server (``celery -A app tooleffect mcp``) with the ``mcp`` SDK's own
client, over stdio and streamable HTTP, against real workers on Redis."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import ClientSession, MCPError
from mcp.client.streamable_http import streamable_http_client

from celery_tooleffect import DeadLetters, call_task_id
from celery_tooleffect.agents import STATUS_TOOL
from celery_tooleffect.store.keys import Keys
from tests.agents.conftest import ROOT, Agents, Poll
from tests.apps.agent_tools_app import build


def text(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


async def until(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` without blocking the event loop."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.05)


def test_tools_list_names_schemas_and_annotations_per_effect(agents: Agents) -> None:
    async def scenario() -> list[types.Tool]:
        async with agents.stdio() as session:
            return (await session.list_tools()).tools

    tools = {tool.name: tool for tool in anyio.run(scenario)}
    assert sorted(tools) == ["shop.charge", "shop.export", "shop.payout", "shop.quote",
                             "shop.refund", "shop.search", "shop.send_invoice", "shop.stock",
                             "shop.wire", STATUS_TOOL]
    search, invoice, refund = tools["shop.search"], tools["shop.send_invoice"], tools["shop.refund"]
    assert search.input_schema == {
        "type": "object", "additionalProperties": False, "required": ["query"],
        "properties": {"query": {"type": "string", "title": "Query",
                                 "description": "What to look for"},
                       "limit": {"type": "integer", "title": "Limit", "default": 3}}}
    assert search.description == "Search the catalog. Changes nothing."
    assert search.output_schema is not None
    assert search.output_schema["properties"]["result"] == {"type": "array",
                                                           "items": {"type": "string"}}
    quote = tools["shop.quote"].output_schema
    assert quote is not None and quote["properties"]["result"]["required"] == ["sku", "cents"]
    assert refund.input_schema["properties"]["reason"]["enum"] == ["damaged", "late"]
    hints = {name: (tool.annotations.read_only_hint, tool.annotations.destructive_hint,
                    tool.annotations.idempotent_hint, tool.annotations.open_world_hint)
             for name, tool in tools.items() if tool.annotations is not None}
    assert hints["shop.search"] == (True, False, True, True)
    assert hints["shop.refund"] == (False, True, True, True)
    assert hints["shop.send_invoice"] == (False, True, False, True)
    assert hints[STATUS_TOOL] == (True, False, True, False)
    assert invoice.annotations is not None and invoice.annotations.title == (
        "Send an invoice: doing it twice sends two.")
    # Operator actions are never tools.
    assert not [name for name in tools if any(word in name for word in
                                               ("replay", "purge", "approve", "reject"))]


def test_a_read_and_a_write_answer_their_results_with_progress(agents: Agents) -> None:
    agents.worker()
    agents.hold("inv-1")
    progress: list[str] = []

    async def scenario() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with agents.stdio() as session:
            read = await session.call_tool("shop.search", {"query": "cable", "limit": 2})
            answers: list[types.CallToolResult] = []

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                progress.append(message or "")

            async def write() -> None:
                answers.append(await session.call_tool(
                    "shop.send_invoice", {"key": "inv-1", "cents": 1999},
                    progress_callback=on_progress))

            async with anyio.create_task_group() as group:
                group.start_soon(write)
                await until(lambda: agents.runs("inv-1") == 1)
                await until(lambda: any("running" in line for line in progress))
                agents.release("inv-1")
            return read, answers[0]

    read, write = anyio.run(scenario)
    assert not read.is_error
    assert read.structured_content is not None
    assert read.structured_content["result"] == ["cable-0", "cable-1"]
    assert read.structured_content["status"] == "succeeded"
    assert text(read) == '["cable-0", "cable-1"]'
    assert not write.is_error and text(write) == "INV-inv-1-1"
    assert write.structured_content is not None
    task_id = write.structured_content["task_id"]
    assert any(f"shop.send_invoice: running (task_id {task_id})" == line for line in progress)
    assert agents.runs("inv-1") == 1


def test_a_failing_write_is_an_error_result_naming_class_reason_and_task(
        agents: Agents) -> None:
    agents.worker()

    async def scenario() -> types.CallToolResult:
        async with agents.stdio() as session:
            return await session.call_tool("shop.charge", {"key": "big", "cents": 500_000})

    result = anyio.run(scenario)
    assert result.is_error
    content = result.structured_content
    assert content is not None
    assert (content["status"], content["failure_class"], content["dead_letter_reason"],
            content["error_type"]) == ("dead_lettered", "client_error", "not_retryable",
                                       "CardDeclined")
    assert content["task_id"] in text(result) and "not_retryable" in text(result)
    letter = DeadLetters(build(agents.prefix)).get(content["task_id"])
    assert letter is not None and letter.name == "shop.charge"
    assert agents.runs("big") == 1


@pytest.mark.parametrize("transport", ["stdio", "streamable-http"])
def test_a_write_whose_result_cannot_be_stored_ran_once_and_the_model_is_told_why(
        agents: Agents, monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """``shop.tag`` returns a set, which the JSON result serializer cannot
    encode: the write ran once, and the call's answer (and the status tool's)
    names the encoder's error and the type, and says it took effect."""
    monkeypatch.setenv("TE_UNSTORABLE_TOOL", "1")
    agents.worker()

    async def scenario() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with contextlib.AsyncExitStack() as stack:
            session = await stack.enter_async_context(
                agents.stdio() if transport == "stdio" else agents.http(agents.http_server()))
            called = await session.call_tool("shop.tag", {"key": "t1"})
            assert called.structured_content is not None
            status = await session.call_tool(
                STATUS_TOOL, {"task_id": called.structured_content["task_id"]})
            return called, status

    called, status = anyio.run(scenario)
    assert called.is_error
    content = called.structured_content
    assert content is not None
    assert (content["status"], content["failure_class"], content["dead_letter_reason"],
            content["error_type"], content["body_completed"]) == (
        "dead_lettered", "unknown", "not_retryable", "ResultNotStorable", True)
    said = text(called)
    assert "cannot encode a set: EncodeError: Object of type set is not JSON serializable" \
        in said
    assert "It ran to its end" in said and content["task_id"] in said
    assert status.structured_content is not None
    assert status.structured_content["error"] == content["error"]
    assert agents.runs("t1") == 1
    letter = DeadLetters(build(agents.prefix)).get(content["task_id"])
    assert letter is not None and letter.body_completed and letter.name == "shop.tag"


def test_an_approval_waits_then_the_status_tool_answers_once_approved(agents: Agents) -> None:
    agents.worker()

    async def scenario() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with agents.stdio() as session:
            parked = await session.call_tool("shop.refund", {"key": "r1", "cents": 700})
            assert parked.structured_content is not None
            task_id = parked.structured_content["task_id"]
            assert agents.runs("r1") == 0
            approved = await anyio.to_thread.run_sync(lambda: subprocess.run(
                agents.command("approvals", "approve", task_id, "--by", "test",
                               "--reason", "checked"),
                env={**os.environ, **agents.env}, capture_output=True,
                text=True, timeout=60, cwd=str(ROOT)))
            assert approved.returncode == 0, approved.stdout + approved.stderr
            answer = None
            with anyio.fail_after(30):
                while True:
                    answer = await session.call_tool(STATUS_TOOL, {"task_id": task_id})
                    assert answer.structured_content is not None
                    if answer.structured_content["status"] == "succeeded":
                        break
                    await anyio.sleep(0.2)
            return parked, answer

    parked, status = anyio.run(scenario)
    assert not parked.is_error
    assert parked.structured_content is not None
    assert parked.structured_content["status"] == "awaiting_approval"
    assert "waiting for a person's approval" in text(parked)
    assert STATUS_TOOL in text(parked)
    assert not status.is_error
    assert status.structured_content is not None
    assert status.structured_content["result"] == "refunded 700 (late)"
    assert agents.runs("r1") == 1


def test_a_call_resent_after_the_worker_died_mid_write_ran_once(agents: Agents) -> None:
    """SIGKILL of the worker while the write's body runs; the client gives up
    and sends the same call again (same idempotency key and run) in a new
    session: it is the same task, dead-lettered as an interrupted write, and
    the body ran once."""
    first = agents.worker()
    agents.hold("inv-k")
    meta = {"idempotencyKey": "call-7", "runId": "run-42"}
    arguments = {"key": "inv-k", "cents": 500}

    async def first_session() -> None:
        async with agents.stdio() as session, anyio.create_task_group() as group:
            group.start_soon(lambda: session.call_tool("shop.send_invoice", arguments,
                                                       meta=meta))
            await until(lambda: agents.runs("inv-k") == 1)
            first.kill()
            group.cancel_scope.cancel()  # the client gives up on the call

    anyio.run(first_session)
    agents.release("inv-k")
    agents.worker()

    async def second_session() -> types.CallToolResult:
        async with agents.stdio() as session:
            return await session.call_tool("shop.send_invoice", arguments, meta=meta)

    result = anyio.run(second_session)
    assert result.is_error
    content = result.structured_content
    assert content is not None
    assert content["task_id"] == call_task_id("call-7", "run-42")
    assert (content["status"], content["dead_letter_reason"]) == ("dead_lettered",
                                                                  "interrupted_write")
    assert "may or may not have taken effect" in text(result)
    assert agents.runs("inv-k") == 1


@pytest.mark.parametrize(("arguments", "field"), [
    ({"key": "b1"}, "cents: Field required"),
    ({"key": "b1", "cents": "many"}, "cents: Input should be a valid integer"),
    ({"key": "b1", "cents": 1, "coupon": "x"}, "coupon: Extra inputs are not permitted"),
    ({"key": "b1" * 3000, "cents": 1}, "bytes of JSON; a call takes at most 4096"),
])
def test_bad_arguments_are_an_error_naming_the_field_and_nothing_is_published(
        agents: Agents, arguments: dict[str, Any], field: str) -> None:
    async def scenario() -> types.CallToolResult:
        async with agents.stdio() as session:
            return await session.call_tool("shop.send_invoice", arguments)

    result = anyio.run(scenario)
    assert result.is_error
    assert field in text(result)
    assert result.structured_content is not None
    assert result.structured_content["status"] == "refused"
    assert result.structured_content["task_id"] == ""
    # No worker runs: a published call would sit in the queue.
    assert agents.redis.llen(f"{agents.prefix}tools") == 0
    assert not agents.redis.keys(f"{agents.prefix}*")


def test_an_unknown_tool_is_a_protocol_error(agents: Agents) -> None:
    async def scenario() -> MCPError:
        async with agents.stdio() as session:
            with pytest.raises(MCPError) as raised:
                await session.call_tool("shop.nope", {})
            return raised.value

    error = anyio.run(scenario)
    assert error.code == types.INVALID_PARAMS
    assert "Unknown tool: shop.nope" in error.message


def test_a_client_that_disconnects_mid_call_finds_it_with_the_status_tool(
        agents: Agents) -> None:
    agents.worker()
    agents.hold("inv-d")
    seen: list[str] = []

    async def leave() -> None:
        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            seen.append(message or "")

        async with agents.stdio() as session, anyio.create_task_group() as group:
            group.start_soon(lambda: session.call_tool(
                "shop.send_invoice", {"key": "inv-d", "cents": 1}, progress_callback=on_progress))
            await until(lambda: any("running" in line for line in seen))
            group.cancel_scope.cancel()

    anyio.run(leave)  # the server process ends with its client
    task_id = seen[-1].rsplit("task_id ", 1)[1].rstrip(")")
    agents.release("inv-d")

    async def ask() -> types.CallToolResult:
        async with agents.stdio() as session:
            with anyio.fail_after(30):
                while True:
                    answer = await session.call_tool(STATUS_TOOL, {"task_id": task_id})
                    assert answer.structured_content is not None
                    if answer.structured_content["status"] == "succeeded":
                        return answer
                    await anyio.sleep(0.1)

    answer = anyio.run(ask)
    assert answer.structured_content is not None
    assert answer.structured_content["result"] == "INV-inv-d-1"
    assert agents.runs("inv-d") == 1


def test_streamable_http_asks_for_the_bearer_token(agents: Agents) -> None:
    agents.worker()
    url = agents.http_server()
    refused = httpx2.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                          headers={"Accept": "application/json, text/event-stream"})
    assert refused.status_code == 401
    wrong = httpx2.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                        headers={"Authorization": "Bearer guess"})
    assert wrong.status_code == 401

    async def scenario() -> tuple[list[str], types.CallToolResult]:
        async with agents.http(url) as session:
            names = [tool.name for tool in (await session.list_tools()).tools]
            return names, await session.call_tool("shop.quote", {"sku": "hdmi"})

    names, quote = anyio.run(scenario)
    assert "shop.send_invoice" in names
    assert not quote.is_error
    assert quote.structured_content is not None
    assert quote.structured_content["result"] == {"sku": "hdmi", "cents": 1999}


def test_streamable_http_beyond_loopback_needs_a_token(agents: Agents) -> None:
    refused = subprocess.run(
        agents.command("mcp", "--transport", "streamable-http", "--host", "0.0.0.0"),
        env={**os.environ, **agents.env}, capture_output=True, text=True,
        timeout=60, cwd=str(ROOT))
    assert refused.returncode == 1
    assert "set tooleffect_mcp_token (or --token-env)" in refused.stderr


def test_a_tool_whose_signature_cannot_be_described_is_refused_at_start(
        agents: Agents) -> None:
    refused = subprocess.run(
        agents.command("mcp"), env={**os.environ, **agents.env,
                                    "TE_UNTYPED_TOOL": "1"},
        capture_output=True, text=True, timeout=60, input="",
        cwd=str(ROOT))
    assert refused.returncode == 1
    assert "shop.untyped: parameter 'key' has no type annotation" in refused.stderr


def test_a_broker_and_store_that_do_not_answer_are_a_connection_error_naming_the_retry(
        agents: Agents, second_redis: Any) -> None:
    """The app's broker and store are a redis-server of the test's own, stopped
    once the server runs: nothing is published, and the model is told whether
    calling again is the same call."""
    agents.env["TE_BROKER"] = second_redis.url

    async def scenario() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with agents.stdio() as session:
            await session.list_tools()
            second_redis.kill()
            keyed = await session.call_tool("shop.send_invoice", {"key": "x", "cents": 1},
                                            meta={"idempotencyKey": "k-down"})
            unkeyed = await session.call_tool("shop.search", {"query": "usb"})
            return keyed, unkeyed

    keyed, unkeyed = anyio.run(scenario)
    for result in (keyed, unkeyed):
        assert result.is_error
        assert result.structured_content is not None
        assert (result.structured_content["status"],
                result.structured_content["failure_class"]) == ("refused", "connection")
        assert "not published, the broker or store did not answer" in text(result)
    assert "call again with the same call id" in text(keyed)
    assert "calling again is a new call" in text(unkeyed)
    assert agents.runs("x") == 0


def test_a_client_of_the_newer_protocol_reads_and_writes_once_by_its_key(
        agents: Agents) -> None:
    """``mcp.Client`` negotiates the 2026-07-28 protocol (no session): the run
    is the ``runId`` the client sends; the same key and run is the same call."""
    from mcp import Client, StdioServerParameters

    agents.worker()
    command = agents.command("mcp")
    server = StdioServerParameters(command=command[0], args=command[1:],
                                   env={**os.environ, **agents.env}, cwd=str(ROOT))
    meta = {"idempotencyKey": "newer-1", "runId": "run-newer"}

    async def scenario() -> tuple[str, list[types.CallToolResult]]:
        async with Client(server) as client:
            answers = [await client.call_tool("shop.search", {"query": "hub"})]
            for _ in range(2):
                answers.append(await client.call_tool(
                    "shop.send_invoice", {"key": "newer", "cents": 7}, meta=meta))
            return str(client.protocol_version), answers

    version, (read, first, again) = anyio.run(scenario)
    assert version == "2026-07-28"
    assert read.structured_content is not None
    assert read.structured_content["result"] == ["hub-0", "hub-1", "hub-2"]
    for answer in (first, again):
        assert not answer.is_error and text(answer) == "INV-newer-1"
        assert answer.structured_content is not None
        assert answer.structured_content["task_id"] == call_task_id("newer-1", "run-newer")
    assert agents.runs("newer") == 1


def test_the_status_tool_answers_only_for_served_tools_and_names_the_tool(
        agents: Agents) -> None:
    """A plain Celery task, a tool left out by ``--tool`` and an id nobody
    published all get the same "unknown"; each served call's answer names its
    tool in every state, though results are not extended (no ``result.name``)."""
    from celery_tooleffect import Approvals

    agents.worker()
    app = build(agents.prefix)
    assert not app.conf.result_extended
    plain = app.tasks["plain.echo"].apply_async(("secret",))
    excluded = app.tasks["shop.quote"].apply_async(kwargs={"sku": "hidden"},
                                                   call_id="q-1", run_id="run-x")
    # A served tool published without a chosen id: its dead letter names it.
    undeclared = app.tasks["shop.charge"].apply_async(kwargs={"key": "c-d", "cents": 500_000})
    assert plain.get(timeout=30) == "plain secret"
    assert excluded.get(timeout=30) == {"sku": "hidden", "cents": 1999}
    served = ("--tool", "shop.search", "--tool", "shop.charge", "--tool", "shop.refund",
              "--tool", "shop.send_invoice")

    async def ask(session: Any, task_id: str, want: str) -> types.CallToolResult:
        with anyio.fail_after(30):
            while True:
                answer = await session.call_tool(STATUS_TOOL, {"task_id": task_id})
                assert answer.structured_content is not None
                if answer.structured_content["status"] == want:
                    return answer
                await anyio.sleep(0.1)

    async def scenario() -> tuple[list[types.CallToolResult], dict[str, types.CallToolResult]]:
        async with agents.stdio(*served) as session:
            unknown = [await session.call_tool(STATUS_TOOL, {"task_id": task_id})
                       for task_id in (plain.id, excluded.id, "no-such-call")]
            read = await session.call_tool("shop.search", {"query": "usb"})
            failed = await session.call_tool("shop.charge", {"key": "c-1", "cents": 500_000})
            parked = await session.call_tool("shop.refund", {"key": "r-x", "cents": 5})
            answers: dict[str, types.CallToolResult] = {}
            for name, call, want in (("shop.search", read, "succeeded"),
                                     ("shop.charge", failed, "dead_lettered")):
                assert call.structured_content is not None
                answers[name] = await ask(session, call.structured_content["task_id"], want)
            answers["undeclared"] = await ask(session, undeclared.id, "dead_lettered")
            assert parked.structured_content is not None
            refund_id = parked.structured_content["task_id"]
            answers["parked"] = await ask(session, refund_id, "awaiting_approval")
            await anyio.to_thread.run_sync(
                lambda: Approvals(app).reject(refund_id, by="test", reason="no refunds"))
            answers["shop.refund"] = await ask(session, refund_id, "rejected")
            revoked = await anyio.to_thread.run_sync(lambda: app.tasks[
                "shop.send_invoice"].apply_async(kwargs={"key": "gone", "cents": 1},
                                                 call_id="late-1", run_id="run-x", expires=-1))
            answers["shop.send_invoice"] = await ask(session, revoked.id, "revoked")
            return unknown, answers

    unknown, answers = anyio.run(scenario)
    said = []
    for answer, task_id in zip(unknown, (plain.id, excluded.id, "no-such-call"), strict=True):
        assert not answer.is_error
        content = dict(answer.structured_content or {})
        assert content.pop("task_id") == task_id
        said.append((content.pop("message").replace(task_id, "<id>"), content))
        assert "secret" not in text(answer) and "hidden" not in text(answer)
    assert said[0] == said[1] == said[2]
    assert said[0][1] == {"status": "unknown", "tool": ""}
    assert said[0][0].startswith("No call of the tools served here has task_id <id>")
    named = {"shop.search": "shop.search", "shop.charge": "shop.charge",
             "undeclared": "shop.charge", "parked": "shop.refund", "shop.refund": "shop.refund",
             "shop.send_invoice": "shop.send_invoice"}
    for key, tool in named.items():
        content = answers[key].structured_content
        assert content is not None
        assert content["tool"] == tool, (key, content)
        assert text(answers[key]).startswith(tool) or key == "shop.search", text(answers[key])
    assert text(answers["shop.refund"]).startswith("shop.refund was rejected: a person did not")
    assert text(answers["shop.send_invoice"]).startswith("shop.send_invoice was cancelled")
    assert agents.runs("r-x") == 0 and agents.runs("gone") == 0


def test_a_result_of_5_mb_reaches_the_client_cut_with_a_note(agents: Agents) -> None:
    """The model gets the first 32 KiB (tooleffect_agent_max_result_bytes) and
    a note naming the size and the task id that keeps the whole; the
    structured content leaves the result out, names its size, and still fits
    the tool's output schema (the SDK's client validates it)."""
    agents.worker()
    chars = 2_500_000  # 5 000 000 bytes of UTF-8, never cut inside a character

    async def scenario() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with agents.stdio() as session:
            await session.list_tools()  # the client then checks structuredContent
            answer = await session.call_tool("shop.export", {"chars": chars})
            assert answer.structured_content is not None
            status = await session.call_tool(
                STATUS_TOOL, {"task_id": answer.structured_content["task_id"]})
            return answer, status

    answer, status = anyio.run(scenario)
    for result in (answer, status):
        assert not result.is_error
        content = result.structured_content
        assert content is not None
        task_id = content["task_id"]
        assert (content["status"], content["result_truncated"], content["result_bytes"]) == (
            "succeeded", True, 5_000_000)
        assert "result" not in content
        said = text(result)
        assert content["message"] == said
        shown, note = said.split("\n[cut: ", 1)
        assert shown == "\u00e9" * (32 * 1024 // 2)
        assert note.startswith("the result is 5000000 bytes of text; the first 32768 are "
                               "shown and 4967232 cut (tooleffect_agent_max_result_bytes).")
        assert f"task_id {task_id}" in note and f"AsyncResult('{task_id}').result" in note
        assert len(said.encode()) < 33 * 1024
    assert len(build(agents.prefix).AsyncResult(task_id).get(timeout=10)) == chars


def test_a_cancelled_call_tells_its_task_id_and_whether_its_body_started(
        agents: Agents) -> None:
    """The client cancels (notifications/cancelled, sent by the SDK's client
    when the caller stops waiting) without a progress token: the protocol
    answers a cancelled request with nothing, so the server's warning log
    notification names the task id, whether the body had started, and the
    status tool, which then tells how the call ended (it ran once)."""
    from celery_tooleffect.agents.mcp_server import CANCEL_LOGGER

    notices: list[dict[str, Any]] = []

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        if params.logger == CANCEL_LOGGER and isinstance(params.data, dict):
            notices.append(params.data)

    async def cancel(session: ClientSession, key: str, started: Poll) -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: session.call_tool(
                    "shop.send_invoice", {"key": key, "cents": 3},
                    meta={"idempotencyKey": key, "runId": "run-cx"}))
                await until(started, what=f"{key} to be published or to run")
                scope.cancel()
        await until(lambda: any(n["task_id"] == call_task_id(key, "run-cx") for n in notices),
                    what="the cancelled call's notice")

    # No worker yet: the call is published and stays queued.
    claims = Keys(f"{agents.prefix}te:").call_claim(call_task_id("cx-queued", "run-cx"))

    async def over_stdio() -> None:
        async with agents.stdio(logging_callback=on_log) as session:
            await cancel(session, "cx-queued", lambda: agents.redis.exists(claims))

    anyio.run(over_stdio)
    assert agents.runs("cx-queued") == 0

    agents.worker()
    agents.hold("cx-run")
    url = agents.http_server()

    async def over_http() -> None:
        headers = {"Authorization": "Bearer s3cret"}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) \
                as client, streamable_http_client(url, http_client=client) as (read, write), \
                ClientSession(read, write, logging_callback=on_log) as session:
            await session.initialize()
            await cancel(session, "cx-run", lambda: agents.runs("cx-run") == 1)

    anyio.run(over_http)
    queued, running = notices
    for notice, key in ((running, "cx-run"), (queued, "cx-queued")):
        task_id = call_task_id(key, "run-cx")
        assert (notice["event"], notice["tool"], notice["task_id"]) == (
            "cancelled", "shop.send_invoice", task_id)
        assert f"Ask {STATUS_TOOL} with task_id {task_id} how it ended" in notice["message"]
    assert (running["status"], running["body_started"]) == ("running", True)
    assert "it was running: its body had started" in running["message"]
    assert (queued["status"], queued["body_started"]) == ("queued", False)
    assert "its body had not started" in queued["message"]

    # The calls go on: the status tool tells how each ended.
    agents.release("cx-run")

    async def ask() -> list[types.CallToolResult]:
        answers = []
        async with agents.stdio() as session:
            for key in ("cx-run", "cx-queued"):
                with anyio.fail_after(30):
                    while True:
                        answer = await session.call_tool(
                            STATUS_TOOL, {"task_id": call_task_id(key, "run-cx"),
                                          "run_id": "run-cx"})
                        assert answer.structured_content is not None
                        if answer.structured_content["status"] == "succeeded":
                            answers.append(answer)
                            break
                        await anyio.sleep(0.1)
        return answers

    ran, later = anyio.run(ask)
    assert text(ran) == "INV-cx-run-1" and text(later) == "INV-cx-queued-1"
    assert agents.runs("cx-run") == 1 and agents.runs("cx-queued") == 1


def test_a_sessionless_http_request_with_a_key_and_no_run_is_refused(agents: Agents) -> None:
    """``mcp.Client`` over HTTP negotiates 2026-07-28: no session, so no run
    but the one it sends. A key without ``runId`` is refused (not bound to a
    server-wide run that another client's ``call_0`` would share); with
    ``runId`` it is one call; without a key each request is a call of its own."""
    from mcp import Client

    agents.worker()
    url = agents.http_server(token=None)

    async def scenario() -> tuple[str, list[types.CallToolResult]]:
        async with Client(url) as client:
            answers = [await client.call_tool("shop.send_invoice", {"key": "sl", "cents": 1},
                                              meta={"idempotencyKey": "call_0"})]
            for _ in range(2):
                answers.append(await client.call_tool(
                    "shop.send_invoice", {"key": "sl", "cents": 1},
                    meta={"idempotencyKey": "call_0", "runId": "conv-1"}))
            for _ in range(2):
                answers.append(await client.call_tool("shop.send_invoice",
                                                      {"key": "sl-free", "cents": 1}))
            return str(client.protocol_version), answers

    version, (refused, first, again, free_1, free_2) = anyio.run(scenario)
    assert version == "2026-07-28"
    assert refused.is_error and refused.structured_content is not None
    assert refused.structured_content["status"] == "refused"
    assert text(refused).startswith("shop.send_invoice was not called: an idempotencyKey "
                                    "needs a run")
    assert text(first) == text(again) == "INV-sl-1"
    assert agents.runs("sl") == 1
    assert {text(free_1), text(free_2)} == {"INV-sl-free-1", "INV-sl-free-2"}
