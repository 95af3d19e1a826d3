"""The agent SDK adapters, each run by its framework's own test model through
an agent loop (the OpenAI Agents SDK's ``ScriptedModel``, a LangChain fake
chat model in a LangGraph ReAct agent, pydantic-ai's ``FunctionModel``),
calling real tools on real workers."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from celery_tooleffect import call_task_id
from tests.agents.conftest import Agents
from tests.apps.agent_tools_app import build

#: A tool call the scripted model makes: (function name, arguments, call id).
Call = tuple[str, dict[str, Any], str]
#: What the model saw for each call id: (text, whether the framework marked it an error).
Seen = dict[str, tuple[str, bool]]
Driver = Callable[[Any, list[Call], str], Awaitable[Seen]]


async def openai_agents(app: Any, calls: list[Call], run_id: str) -> Seen:
    from agents import Agent, RunConfig, Runner
    from agents.testing import ScriptedModel, assistant_message, function_call

    from celery_tooleffect.agents.openai_agents import openai_agents_tools

    model = ScriptedModel([[function_call(name, arguments, call_id=call_id)
                            for name, arguments, call_id in calls],
                           [assistant_message("done")]])
    agent = Agent(name="shop", model=model, tools=openai_agents_tools(app))
    result = await Runner.run(agent, "go", run_config=RunConfig(trace_id=run_id,
                                                                tracing_disabled=True))
    assert result.final_output == "done"
    return {item["call_id"]: (str(item["output"]), False) for item in model.calls[-1].input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


async def langchain(app: Any, calls: list[Call], run_id: str) -> Seen:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from celery_tooleffect.agents.langchain import langchain_tools

    class FakeToolModel(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:  # the script knows its tools
            return self

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from langgraph.prebuilt import create_react_agent

        model = FakeToolModel(messages=iter([
            AIMessage(content="", tool_calls=[
                {"name": name, "args": arguments, "id": call_id, "type": "tool_call"}
                for name, arguments, call_id in calls]),
            AIMessage(content="done"),
        ]))
        agent = create_react_agent(model, langchain_tools(app))
    state = await agent.ainvoke({"messages": [HumanMessage("go")]},
                                {"configurable": {"thread_id": run_id}})
    assert state["messages"][-1].content == "done"
    return {message.tool_call_id: (str(message.content), message.status == "error")
            for message in state["messages"] if isinstance(message, ToolMessage)}


async def pydantic_ai(app: Any, calls: list[Call], run_id: str) -> Seen:
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        RetryPromptPart,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from celery_tooleffect.agents.pydantic_ai import pydantic_ai_tools

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart(name, arguments, tool_call_id=call_id)
                                        for name, arguments, call_id in calls])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(script), tools=pydantic_ai_tools(app))
    result = await agent.run("go", conversation_id=run_id)
    assert result.output == "done"
    seen: Seen = {}
    for message in result.all_messages():
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, ToolReturnPart):
                    seen[part.tool_call_id] = (part.model_response_str(),
                                               part.outcome != "success")
                elif isinstance(part, RetryPromptPart) and part.tool_call_id:
                    seen[part.tool_call_id] = (part.model_response(), True)
    return seen


DRIVERS: dict[str, Driver] = {"openai-agents": openai_agents, "langchain": langchain,
                              "pydantic-ai": pydantic_ai}


@pytest.fixture(params=sorted(DRIVERS))
def framework(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def a_run_id(framework: str) -> str:
    # The Agents SDK's trace ids have a form of their own (gen_trace_id()).
    return f"trace_{uuid.uuid4().hex}" if framework == "openai-agents" else uuid.uuid4().hex


def test_an_agent_loop_calls_a_read_and_a_write(agents: Agents, framework: str) -> None:
    agents.worker()
    app = build(agents.prefix)
    run_id = a_run_id(framework)
    calls: list[Call] = [
        ("shop_search", {"query": "usb", "limit": 2}, "call_read"),
        ("shop_send_invoice", {"key": "inv", "cents": 1999}, "call_write"),
        ("shop_charge", {"key": "big", "cents": 500_000}, "call_declined"),
        ("shop_charge", {"key": "bad"}, "call_invalid"),
    ]
    seen = anyio.run(DRIVERS[framework], app, calls, run_id)

    read, is_error = seen["call_read"]
    assert json.loads(read) == ["usb-0", "usb-1"] and not is_error
    write, is_error = seen["call_write"]
    assert write.strip('"') == "INV-inv-1" and not is_error
    declined, is_error = seen["call_declined"]
    assert "dead-lettered (not_retryable)" in declined and "CardDeclined" in declined
    assert is_error or framework == "openai-agents"  # its tool outputs carry no error flag
    invalid, is_error = seen["call_invalid"]
    assert "cents: Field required" in invalid
    assert agents.runs("inv") == 1 and agents.runs("big") == 1 and agents.runs("bad") == 0
    # The framework's tool-call id and run id are the call's identity.
    write_id = call_task_id("call_write", run_id)
    assert app.AsyncResult(write_id).get(timeout=10) == "INV-inv-1"


def test_a_write_whose_result_cannot_be_stored_ran_once_and_the_model_is_told_why(
        agents: Agents, framework: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_UNSTORABLE_TOOL", "1")  # shop.tag returns a set
    agents.worker()
    app = build(agents.prefix)
    seen = anyio.run(DRIVERS[framework], app, [("shop_tag", {"key": "t2"}, "call_tag")],
                     a_run_id(framework))

    said, is_error = seen["call_tag"]
    assert "dead-lettered (not_retryable): ResultNotStorable: " in said
    assert "cannot encode a set: EncodeError: Object of type set is not JSON serializable" \
        in said
    assert "It ran to its end" in said
    assert is_error or framework == "openai-agents"  # its tool outputs carry no error flag
    assert agents.runs("t2") == 1


def test_a_rerun_of_the_same_tool_call_after_a_crash_mid_write_ran_once(
        agents: Agents, framework: str) -> None:
    first = agents.worker()
    app = build(agents.prefix)
    run_id = a_run_id(framework)
    calls: list[Call] = [("shop_send_invoice", {"key": "inv-c", "cents": 5}, "call_crash")]
    agents.hold("inv-c")

    async def crash() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(DRIVERS[framework], app, calls, run_id)
            with anyio.fail_after(30):
                while agents.runs("inv-c") == 0:
                    await anyio.sleep(0.05)
            first.kill()
            group.cancel_scope.cancel()  # the agent run dies with it

    anyio.run(crash)
    agents.release("inv-c")
    agents.worker()
    seen = anyio.run(DRIVERS[framework], app, calls, run_id)

    said, _ = seen["call_crash"]
    assert "dead-lettered (interrupted_write)" in said
    assert "may or may not have taken effect" in said
    assert agents.runs("inv-c") == 1


# -- runs without a run id of the caller's (issue 38: call_0 of each run) ------

Said = list[tuple[str, str]]


async def openai_agents_conversation(app: Any, turns: list[list[Call]]) -> Said:
    """One ``Runner.run`` without trace id or group id, the model's turns as given."""
    from agents import Agent, RunConfig, Runner
    from agents.testing import ScriptedModel, assistant_message, function_call

    from celery_tooleffect.agents.openai_agents import openai_agents_tools

    model = ScriptedModel([*([function_call(name, arguments, call_id=call_id)
                              for name, arguments, call_id in turn] for turn in turns),
                           [assistant_message("done")]])
    agent = Agent(name="shop", model=model, tools=openai_agents_tools(app))
    result = await Runner.run(agent, "go", run_config=RunConfig(tracing_disabled=True))
    assert result.final_output == "done"
    return [(item["call_id"], str(item["output"])) for item in model.calls[-1].input
            if isinstance(item, dict) and item.get("type") == "function_call_output"]


async def langchain_conversation(app: Any, turns: list[list[Call]]) -> Said:
    """One graph invocation without a thread id (and no checkpointer)."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from celery_tooleffect.agents.langchain import langchain_tools

    class FakeToolModel(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from langgraph.prebuilt import create_react_agent

        model = FakeToolModel(messages=iter([
            *(AIMessage(content="", tool_calls=[
                {"name": name, "args": arguments, "id": call_id, "type": "tool_call"}
                for name, arguments, call_id in turn]) for turn in turns),
            AIMessage(content="done"),
        ]))
        agent = create_react_agent(model, langchain_tools(app))
    state = await agent.ainvoke({"messages": [HumanMessage("go")]})
    assert state["messages"][-1].content == "done"
    return [(message.tool_call_id, str(message.content))
            for message in state["messages"] if isinstance(message, ToolMessage)]


async def pydantic_ai_conversation(app: Any, turns: list[list[Call]]) -> Said:
    """One ``Agent.run`` without conversation id or run id."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from celery_tooleffect.agents.pydantic_ai import pydantic_ai_tools

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = (len(messages) - 1) // 2
        if turn < len(turns):
            return ModelResponse(parts=[ToolCallPart(name, arguments, tool_call_id=call_id)
                                        for name, arguments, call_id in turns[turn]])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(script), tools=pydantic_ai_tools(app))
    result = await agent.run("go")
    assert result.output == "done"
    return [(part.tool_call_id, part.model_response_str())
            for message in result.all_messages() if isinstance(message, ModelRequest)
            for part in message.parts if isinstance(part, ToolReturnPart)]


CONVERSATIONS: dict[str, Callable[[Any, list[list[Call]]], Awaitable[Said]]] = {
    "openai-agents": openai_agents_conversation, "langchain": langchain_conversation,
    "pydantic-ai": pydantic_ai_conversation}


def test_each_run_without_a_run_id_is_a_run_of_its_own(agents: Agents, framework: str) -> None:
    """Two conversations whose model numbers its calls ``call_0`` (as local
    model servers do), same arguments, no run id given: the write runs once
    per conversation; the same ``call_0`` resent in a later turn of one
    conversation is the same call."""
    agents.worker()
    app = build(agents.prefix)
    write: Call = ("shop_send_invoice", {"key": "conv", "cents": 100}, "call_0")
    first = anyio.run(CONVERSATIONS[framework], app, [[write], [write]])
    second = anyio.run(CONVERSATIONS[framework], app, [[write], [write]])

    assert agents.runs("conv") == 2
    for said, invoice in ((first, "INV-conv-1"), (second, "INV-conv-2")):
        # The Agents SDK answers a call id it answered before itself, without calling.
        assert len(said) == (1 if framework == "openai-agents" else 2), said
        assert {call_id for call_id, _ in said} == {"call_0"}
        assert {text.strip('"') for _, text in said} == {invoice}, said


def test_a_result_of_5_mb_reaches_the_model_cut_with_a_note(
        agents: Agents, framework: str) -> None:
    agents.worker()
    app = build(agents.prefix)
    run_id = a_run_id(framework)
    seen = anyio.run(DRIVERS[framework], app,
                     [("shop_export", {"chars": 2_500_000}, "call_big")], run_id)

    said, is_error = seen["call_big"]
    assert not is_error
    task_id = call_task_id("call_big", run_id)
    shown, note = said.split("\n[cut: ", 1)
    assert shown == "\u00e9" * (32 * 1024 // 2)
    assert note.startswith("the result is 5000000 bytes of text; the first 32768 are shown")
    assert f"task_id {task_id}" in note
    assert len(said.encode()) < 33 * 1024
    assert len(app.AsyncResult(task_id).get(timeout=10)) == 2_500_000
