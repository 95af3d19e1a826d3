"""The example agents (examples/agents/), run as a user runs them, each with
its framework's own test model, on a redis-server of the test's own (the
example app keeps its keys unprefixed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from celery_tooleffect.testing import RedisServer, redis_server
from tests.agents.conftest import ROOT

AGENTS = ["openai_agents_agent", "langchain_agent", "pydantic_ai_agent"]


@pytest.fixture
def example_redis() -> Iterator[RedisServer]:
    # The example app is a user's deployment: its worker refuses a store
    # that loses what it acknowledged when it restarts (docs/redis.md#durability).
    with redis_server(appendonly=True) as server:
        yield server


def run_example(module: str, server: RedisServer) -> str:
    done = subprocess.run(
        [sys.executable, "-m", f"examples.agents.{module}"], cwd=str(ROOT),
        env={**os.environ, "REDIS_URL": server.url, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("module", AGENTS)
def test_an_example_agent_runs_its_script(module: str, example_redis: RedisServer) -> None:
    transcript = run_example(module, example_redis)
    lines = transcript.splitlines()
    assert lines[0].startswith("user: Find a USB-C cable")
    said = {match[1]: (bool(match[2]), match[3]) for match in
            (re.match(r"tool  <- (\w+) \[\w+\]( \(error\))?: (.*)", line) for line in lines)
            if match}
    assert json.loads(said["agent_search_catalog"][1]) == ["usb-c cable 1m", "usb-c cable 2m"]
    assert said["agent_send_invoice"][1] == "INV-0001"
    declined = said["agent_charge_card"][1]
    assert "dead-lettered (not_retryable): CardDeclined" in declined
    # Every framework but the Agents SDK marks a tool error as one.
    assert said["agent_charge_card"][0] is (module != "openai_agents_agent")
    assert lines[-1] == "model: Invoice sent; the card declined the charge, so nothing was charged."
    client = example_redis.client()
    assert client.llen("world:invoices") == 1
    assert client.llen("world:charges") == 0


def test_the_example_mcp_client_lists_and_calls(example_redis: RedisServer) -> None:
    transcript = run_example("mcp_client", example_redis)
    listed = json.loads(transcript.split("tools/list:\n", 1)[1].split("\ntools/call", 1)[0])
    assert [tool["name"] for tool in listed] == [
        "agent.charge_card", "agent.refund_order", "agent.search_catalog",
        "agent.send_invoice", "agent.set_shipping_address", "agent.sync_crm_contact",
        "tooleffect_call_status"]
    assert "tools/call agent.send_invoice" in transcript and '"result": "INV-0001"' in transcript
