"""A LangGraph ReAct agent calling the example tools, with a LangChain fake
chat model (no API key)::

    python -m examples.agents.langchain_agent

For a real model, give ``create_react_agent`` a chat model that supports tool
calling (``langchain-openai``'s ``ChatOpenAI``, ``langchain-anthropic``'s
``ChatAnthropic``, ...); the tools stay the same.
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from celery_tooleffect.agents.langchain import langchain_tools
from examples.agent_app import app
from examples.agents.common import FINAL, SCRIPT, USER, example_worker, show_call, show_output

with warnings.catch_warnings():
    # create_react_agent moved to langchain.agents.create_agent in LangChain 1.x;
    # langgraph's stays, and needs no more than langchain-core.
    warnings.simplefilter("ignore", DeprecationWarning)
    from langgraph.prebuilt import create_react_agent


class ScriptedChatModel(GenericFakeChatModel):
    """LangChain's fake chat model, which answers with the messages it is given;
    the script already names its tools."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self


async def main() -> None:
    model = ScriptedChatModel(messages=iter([
        AIMessage(content="", tool_calls=[
            {"name": name, "args": arguments, "id": call_id, "type": "tool_call"}
            for name, arguments, call_id in SCRIPT]),
        AIMessage(content=FINAL),
    ]))
    tools = langchain_tools(app, ["agent.search_catalog", "agent.send_invoice",
                                  "agent.charge_card"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        agent = create_react_agent(model, tools)
    print(f"user: {USER}")
    # The thread id is the run id of every call of this thread.
    state = await agent.ainvoke({"messages": [HumanMessage(USER)]},
                                {"configurable": {"thread_id": uuid.uuid4().hex}})
    for message in state["messages"]:
        if isinstance(message, AIMessage):
            for call in message.tool_calls:
                show_call(call["name"], call["args"], str(call["id"]))
            if message.content:
                print(f"model: {message.content}")
        elif isinstance(message, ToolMessage):
            show_output(str(message.name), message.tool_call_id, str(message.content),
                        message.status == "error")


if __name__ == "__main__":
    with example_worker():
        asyncio.run(main())
