"""One agent run on Flower's run page, in a real browser: the OpenAI Agents
SDK's ``ScriptedModel`` calls the tools of ``tests.apps.agent_tools_app`` on a
real worker (a read, a read that is retried once, a write declined into a dead
letter, a refund parked for an operator's approval), and ``/runs/<run_id>`` of
``celery -A tests.apps.agent_tools_app tooleffect flower`` shows each call as
it stands.

Set ``TOOLEFFECT_SCREENSHOT=docs/dead-letters.png`` to refresh the docs' run
page screenshot: the test writes ``run.png`` beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest

from celery_tooleffect import Approvals, DeadLetters, call_task_id
from celery_tooleffect.testing import wait_for
from tests import test_flower as base
from tests.agents.conftest import ROOT, Agents, free_port
from tests.apps.agent_tools_app import build
from tests.test_flower import FlowerProcess, _answers, wait_css
from tests.test_operator_pages import _screenshot

pytestmark = pytest.mark.timeout(240)

browser = base.browser

#: A tool call the scripted model makes: (function name, arguments, call id).
Call = tuple[str, dict[str, Any], str]


@pytest.fixture
def agents_flower(agents: Agents) -> Iterator[Callable[[], FlowerProcess]]:
    """Start ``celery -A tests.apps.agent_tools_app tooleffect flower`` on a free
    port, under the agents' key prefix."""
    started: list[FlowerProcess] = []

    def start() -> FlowerProcess:
        port = free_port()
        log = agents.tmp_path / f"flower-{port}.log"
        process = subprocess.Popen(
            agents.command("flower", f"--port={port}", "--address=127.0.0.1"),
            stdout=log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, **agents.env}, cwd=str(ROOT), start_new_session=True)
        flower = FlowerProcess(f"http://127.0.0.1:{port}", process, log)
        started.append(flower)
        wait_for(lambda: _answers(flower) or process.poll() is not None, timeout=40,
                 what="Flower to answer")
        assert process.poll() is None, flower.output()
        return flower

    yield start
    for flower in started:
        if flower.process.poll() is None:
            flower.process.terminate()
            try:
                flower.process.wait(15)
            except subprocess.TimeoutExpired:
                flower.process.kill()


async def agent_run(app: Any, turns: list[list[Call]], run_id: str) -> dict[str, str]:
    """One ``Runner.run`` of the model's ``turns``, its trace id ``run_id``: what
    the model was told for each call id."""
    from agents import Agent, RunConfig, Runner
    from agents.testing import ScriptedModel, assistant_message, function_call

    from celery_tooleffect.agents.openai_agents import openai_agents_tools

    model = ScriptedModel([*([function_call(name, arguments, call_id=call_id)
                              for name, arguments, call_id in turn] for turn in turns),
                           [assistant_message("done")]])
    agent = Agent(name="shop", model=model, tools=openai_agents_tools(app))
    result = await Runner.run(agent, "go", run_config=RunConfig(trace_id=run_id,
                                                                tracing_disabled=True))
    assert result.final_output == "done"
    return {item["call_id"]: str(item["output"]) for item in model.calls[-1].input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


def test_an_agent_runs_page_shows_its_reads_retry_dead_letter_and_approval_wait(
    agents: Agents, agents_flower: Callable[[], FlowerProcess], browser: Any,
) -> None:
    from selenium.webdriver.common.by import By

    agents.worker()
    app = build(agents.prefix)
    run_id = f"trace_{uuid.uuid4().hex}"
    turns: list[list[Call]] = [
        [("shop_search", {"query": "usb hub", "limit": 2}, "call_search")],
        [("shop_quote", {"sku": "usb hub-0"}, "call_quote"),
         ("shop_stock", {"sku": "usb hub-0"}, "call_stock")],
        [("shop_charge", {"key": "order-7", "cents": 250_000}, "call_charge")],
        [("shop_refund", {"key": "order-6", "cents": 1999, "reason": "damaged"},
          "call_refund")],
    ]
    told = anyio.run(agent_run, app, turns, run_id)

    # What the model was told: the reads' results (the retried one's too), the
    # dead letter, the wait for a person.
    assert json.loads(told["call_search"]) == ["usb hub-0", "usb hub-1"]
    assert json.loads(told["call_quote"]) == {"sku": "usb hub-0", "cents": 1999}
    assert told["call_stock"] == "7"
    assert "dead-lettered (not_retryable)" in told["call_charge"]
    assert "CardDeclined" in told["call_charge"]
    assert "waiting for a person's approval; nothing of it has run" in told["call_refund"]
    assert int(agents.redis.get(f"{agents.prefix}stock:usb hub-0") or 0) == 2
    assert agents.runs("order-7") == 1 and agents.runs("order-6") == 0
    ids = {call_id: call_task_id(call_id, run_id)
           for call_id in ("call_search", "call_quote", "call_stock", "call_charge",
                           "call_refund")}
    assert DeadLetters(app).get(ids["call_charge"]) is not None
    assert Approvals(app).get(ids["call_refund"]) is not None

    flower = agents_flower()
    browser.get(f"{flower.url}/runs/{run_id}")
    wait_css(browser, "#run-timeline")
    shown_id = browser.find_element(By.CSS_SELECTOR, "#run-id").get_attribute("textContent")
    assert shown_id == run_id  # (the page's eyebrow shows it in capitals)
    rows = {row.get_attribute("data-task-id"): row
            for row in browser.find_elements(By.CSS_SELECTOR, "tr.run-call")}
    assert sorted(rows) == sorted(ids.values())
    state = {call_id: rows[task_id].get_attribute("data-state")
             for call_id, task_id in ids.items()}
    assert state == {"call_search": "succeeded", "call_quote": "succeeded",
                     "call_stock": "succeeded", "call_charge": "dead_lettered",
                     "call_refund": "awaiting_approval"}
    for call_id, tool in (("call_search", "shop.search"), ("call_quote", "shop.quote"),
                          ("call_stock", "shop.stock"), ("call_charge", "shop.charge"),
                          ("call_refund", "shop.refund")):
        assert tool in rows[ids[call_id]].text

    def bodies(call_id: str) -> str:
        cell = rows[ids[call_id]].find_element(By.CSS_SELECTOR, "td.call-bodies")
        return str(cell.text)

    # The retry: two bodies ran, the first's bar failed, the second's succeeded.
    assert bodies("call_stock") == "2" and bodies("call_search") == "1"
    spans = [span.get_attribute("textContent")
             for span in browser.find_elements(By.CSS_SELECTOR, "#run-timeline rect.timeline-span")]
    assert [span for span in spans if span.startswith("shop.stock")] == [
        "shop.stock attempt: failed", "shop.stock attempt: succeeded"]
    # The dead letter: its reason, and its task id leads to it.
    charge = rows[ids["call_charge"]]
    assert "not_retryable" in charge.text and "CardDeclined" in charge.text
    assert charge.find_element(By.CSS_SELECTOR, "a.call-link").get_attribute(
        "href").endswith(f"/dead-letters/{ids['call_charge']}")
    # The approval: asked, nothing ran; its task id leads to the approval.
    refund = rows[ids["call_refund"]]
    assert refund.text.count("approval requested") == 1 and bodies("call_refund") == "—"
    assert refund.find_element(By.CSS_SELECTOR, "a.call-link").get_attribute(
        "href").endswith(f"/approvals/{ids['call_refund']}")
    _screenshot(browser, "run.png")

