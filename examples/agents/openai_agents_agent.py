"""An OpenAI Agents SDK agent calling the example tools, with the SDK's own
``ScriptedModel`` (no API key)::

    python -m examples.agents.openai_agents_agent

For a real model, drop ``model=`` (the SDK's default model, ``OPENAI_API_KEY``)
or give one of yours; the tools stay the same.
"""

from __future__ import annotations

import asyncio

from agents import Agent, RunConfig, Runner, gen_trace_id
from agents.testing import ScriptedModel, assistant_message, function_call
from celery_tooleffect.agents.openai_agents import openai_agents_tools
from examples.agent_app import app
from examples.agents.common import FINAL, SCRIPT, USER, example_worker, show_call, show_output


async def main() -> None:
    model = ScriptedModel([
        [function_call(name, arguments, call_id=call_id) for name, arguments, call_id in SCRIPT],
        [assistant_message(FINAL)],
    ])
    agent = Agent(name="shop assistant", model=model,
                  tools=openai_agents_tools(app, ["agent.search_catalog", "agent.send_invoice",
                                                  "agent.charge_card"]))
    print(f"user: {USER}")
    # The trace id is the run id of every call of this run.
    result = await Runner.run(agent, USER, run_config=RunConfig(trace_id=gen_trace_id(),
                                                                tracing_disabled=True))
    outputs = {item["call_id"]: item["output"] for item in model.calls[-1].input
               if isinstance(item, dict) and item.get("type") == "function_call_output"}
    for name, arguments, call_id in SCRIPT:
        show_call(name, arguments, call_id)
        show_output(name, call_id, str(outputs[call_id]))
    print(f"model: {result.final_output}")


if __name__ == "__main__":
    with example_worker():
        asyncio.run(main())
