"""A pydantic-ai agent calling the example tools, with pydantic-ai's own
``FunctionModel`` (no API key)::

    python -m examples.agents.pydantic_ai_agent

For a real model, give ``Agent`` a model name (``"openai:gpt-5"``,
``"anthropic:claude-sonnet-4-5"``, ...) and its provider's key; the tools stay
the same.
"""

from __future__ import annotations

import asyncio
import uuid

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
from examples.agent_app import app
from examples.agents.common import FINAL, SCRIPT, USER, example_worker, show_call, show_output


def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The model: the script's calls first, then the answer."""
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart(name, arguments, tool_call_id=call_id)
                                    for name, arguments, call_id in SCRIPT])
    return ModelResponse(parts=[TextPart(FINAL)])


async def main() -> None:
    agent = Agent(FunctionModel(scripted),
                  tools=pydantic_ai_tools(app, ["agent.search_catalog", "agent.send_invoice",
                                                "agent.charge_card"]))
    print(f"user: {USER}")
    # The conversation id is the run id of every call of this conversation.
    result = await agent.run(USER, conversation_id=uuid.uuid4().hex)
    for message in result.all_messages():
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                show_call(part.tool_name, part.args_as_dict(), part.tool_call_id)
            elif isinstance(part, ToolReturnPart) and isinstance(message, ModelRequest):
                show_output(part.tool_name, part.tool_call_id, part.model_response_str(),
                            part.outcome != "success")
            elif isinstance(part, TextPart):
                print(f"model: {part.content}")


if __name__ == "__main__":
    with example_worker():
        asyncio.run(main())
