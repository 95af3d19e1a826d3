"""What operators see and decide: a call's arguments on its approval (as the
tool shows them to approvers), and a run's calls in order with their timeline,
in the real Flower, the CLI and the store.

A real ``celery -A tests.apps.tool_app worker`` (``spawn_worker``) parks and
runs the calls; Flower is ``celery -A tests.apps.tool_app tooleffect flower``
(tests/test_flower.py's fixture). Set ``TOOLEFFECT_SCREENSHOT=docs/dead-letters.png``
to refresh the docs' screenshots: the browser test writes ``approval-arguments.png``
and ``run.png`` beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain

from celery_tooleffect import Approvals, AuditLog, DeadLetters
from celery_tooleffect.events import AuditEvent
from celery_tooleffect.store.runs import RunCalls
from celery_tooleffect.store.runtime import runtime_for
from tests import test_flower as base
from tests.conftest import REDIS_URL, TESTS, Counter, WorkerProcess, wait_for
from tests.test_flower import FlowerProcess, _request, click, wait_css

pytestmark = pytest.mark.timeout(240)

start_flower = base.start_flower
browser = base.browser

USER = "ops:s3cret"
CARD = "4242424242424242"


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    return make_app()


def park(app: Celery, name: str, *args: Any) -> Any:
    result = app.send_task(name, args=list(args), queue="tools")
    wait_for(lambda: Approvals(app).get(result.id), timeout=60,
             what=f"{name}[{result.id}] to be parked")
    return result


def cli(prefix: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TE_PREFIX": prefix, "TE_BROKER": REDIS_URL,
           "PYTHONPATH": str(TESTS.parent), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.tool_app",
                           "tooleffect", *arguments], env=env, capture_output=True, text=True,
                          timeout=60, cwd=str(TESTS.parent))


def decision(app: Celery, task_id: str) -> dict[str, str]:
    [event] = [event for event in AuditLog(app).events(task_id)
               if event["phase"] == "approval" and event["status"] != "requested"]
    return dict(event)


# -- approvals show the call ---------------------------------------------------------------


def test_an_approval_shows_the_arguments_as_the_tool_shows_them_and_audits_what_was_shown(
    app: Celery, prefix: str, spawn_worker: Callable[..., WorkerProcess],
    start_flower: Callable[..., FlowerProcess], counter: Counter,
) -> None:
    spawn_worker(concurrency=1)
    flower = start_flower(f"--basic-auth={USER}")
    key, plain_key = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    pay = park(app, "tools.pay", key, CARD, 1999)
    plain = park(app, "tools.approved_write", plain_key)

    status, body = _request(f"{flower.url}/api/approvals/{pay.id}", user=USER)
    assert status == 200, body
    shown = json.loads(body)["shown"]
    assert shown["view"] == {"card": "**** **** **** 4242", "amount": "19.99"}
    assert shown["args"] is None and shown["problem"] is None and len(shown["digest"]) == 64
    assert CARD not in body
    status, page = _request(f"{flower.url}/approvals/{pay.id}", user=USER)
    assert status == 200 and "**** **** **** 4242" in page and CARD not in page
    assert f'value="{shown["digest"]}"' in page  # the forms carry what was shown

    status, body = _request(f"{flower.url}/api/approvals/{plain.id}", user=USER)
    assert json.loads(body)["shown"]["args"] == [plain_key]

    shown_cli = cli(prefix, "approvals", "show", pay.id)
    assert shown_cli.returncode == 0, shown_cli.stderr
    assert "as the tool shows them to approvers" in shown_cli.stdout
    assert "**** **** **** 4242" in shown_cli.stdout and CARD not in shown_cli.stdout

    # A decision taken on what is no longer shown is refused; on what is, taken.
    api = f"{flower.url}/api/approvals/{pay.id}/approve"
    status, body = _request(api, method="POST", user=USER,
                            body={"reason": "ok", "shown_digest": "0" * 64},
                            headers={"Origin": flower.url})
    assert status == 409 and "changed since it was shown to you" in body, body
    status, body = _request(api, method="POST", user=USER,
                            body={"reason": "checked the card", "shown_digest": shown["digest"]},
                            headers={"Origin": flower.url})
    assert status == 200, body
    assert pay.get(timeout=60) == key and counter.value(key) == 1
    event = decision(app, pay.id)
    assert event["shown_digest"] == shown["digest"]
    assert "shown" not in event  # privacy "metadata": the digest, never the values
    assert CARD not in json.dumps(event)


def test_arguments_that_cannot_be_shown_are_hidden_saying_why_and_the_call_is_decidable(
    app: Celery, prefix: str, make_app: Callable[..., Celery],
    spawn_worker: Callable[..., WorkerProcess], counter: Counter,
) -> None:
    spawn_worker(concurrency=1)
    key = uuid.uuid4().hex[:8]
    broken = park(app, "tools.pay_broken_view", key)
    shown_cli = cli(prefix, "approvals", "show", broken.id, "--json")
    assert shown_cli.returncode == 0, shown_cli.stderr
    shown = json.loads(shown_cli.stdout)["shown"]
    assert shown["problem"] == ("the tool's approval_view raised RuntimeError: the masking "
                                "service is down; the arguments are hidden")
    assert shown["args"] is None and shown["view"] is None and key not in shown_cli.stdout

    # An operator app that accepts no JSON cannot decode the kept message: shown
    # as such, never executed.
    approval = Approvals(app).get(broken.id)
    assert approval is not None
    undecodable = Approvals(make_app(accept_content=["yaml"])).arguments(approval)
    assert undecodable.problem.startswith(
        "the arguments cannot be decoded with this app's accept_content (ContentDisallowed")
    assert undecodable.args is None and undecodable.view is None

    approved = cli(prefix, "approvals", "approve", broken.id, "--by", "ops", "--reason",
                   "checked by phone")
    assert approved.returncode == 0, approved.stdout + approved.stderr
    assert broken.get(timeout=60) == key and counter.value(key) == 1
    event = decision(app, broken.id)
    assert event["shown_digest"] == shown["digest"]
    assert event["shown_problem"].startswith("the tool's approval_view raised RuntimeError")


# -- a run's timeline -----------------------------------------------------------------------


def test_a_run_page_lists_a_chain_and_a_dead_letter_in_order(
    app: Celery, prefix: str, spawn_worker: Callable[..., WorkerProcess],
    start_flower: Callable[..., FlowerProcess],
) -> None:
    spawn_worker(concurrency=1)
    keys = [uuid.uuid4().hex[:8] for _ in range(3)]
    steps = chain(app.signature("tools.read", args=[keys[0]], immutable=True, queue="tools"),
                  app.signature("tools.idempotent", args=[keys[1]], immutable=True,
                                queue="tools"),
                  app.signature("tools.write", args=[keys[2]], immutable=True, queue="tools"))
    last = steps.apply_async()
    assert last.get(timeout=60) == keys[2]
    run_id = str(last.parent.parent.id)  # the chain's root: the run of its calls
    wrong = app.send_task("tools.write", kwargs={"no_such_argument": 1}, queue="tools",
                          headers={"tooleffect_run_id": run_id})
    wait_for(lambda: DeadLetters(app).get(wrong.id), timeout=60, what="the dead letter")

    flower = start_flower(f"--basic-auth={USER}")
    status, body = _request(f"{flower.url}/api/runs/{run_id}", user=USER)
    assert status == 200, body
    page = json.loads(body)
    calls = page["calls"]
    assert [call["tool"] for call in calls] == ["tools.read", "tools.idempotent", "tools.write",
                                                "tools.write"]
    assert [call["state"] for call in calls] == ["succeeded"] * 3 + ["dead_lettered"]
    assert [call["effect"] for call in calls[:3]] == ["read_only", "idempotent_write",
                                                      "non_idempotent_write"]
    assert calls[3]["task_id"] == wrong.id and calls[3]["dead_letter_reason"]
    assert calls[2]["attempts"] == 1 and calls[2]["spans"][0]["status"] == "succeeded"
    assert page["next_cursor"] is None
    status, html_page = _request(f"{flower.url}/runs/{run_id}", user=USER)
    assert status == 200
    assert f'href="/dead-letters/{wrong.id}"' in html_page
    assert html_page.count('class="run-call"') == 4 and "timeline-span" in html_page

    shown = cli(prefix, "runs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    for call in calls:
        assert call["task_id"] in shown.stdout
    assert "dead_lettered" in shown.stdout

    # The dead letter's page shows its audit trail and links its run.
    status, letter_page = _request(f"{flower.url}/dead-letters/{wrong.id}", user=USER)
    assert status == 200
    assert f'href="/runs/{run_id}"' in letter_page and 'id="letter-audit"' in letter_page


def test_a_run_of_thousands_of_calls_is_paged_at_a_bounded_cost(
    app: Celery, prefix: str,
) -> None:
    """3,000 calls of one run, four events each (as a write has: intent,
    outcome, and a read's deferral and outcome between them), paged 200 at a
    time: every call once, in order, each page reading a bounded number of
    events."""
    audit = runtime_for(app).audit
    run_id = f"big-{uuid.uuid4().hex[:6]}"
    now = time.time()
    events = []
    for n in range(3000):
        common = dict(run_id=run_id, task_id=f"t{n:05d}", tool="tools.write",
                      effect="non_idempotent_write", worker="w", queue="tools")
        events.append(AuditEvent.of(phase="intent", status="started", attempt=1, **common))
        events.append(AuditEvent.of(phase="outcome", status="succeeded", attempt=1,
                                    duration_ms=2.0, **common))
    assert all(audit.record_steps(events[i:i + 500]) for i in range(0, len(events), 500))

    seen: list[str] = []
    cursor = None
    pages = 0
    started = time.perf_counter()
    while True:
        page = RunCalls(audit).page(run_id, cursor=cursor, limit=200)
        pages += 1
        assert page.events_read <= 200 * 2 + 2000 + 1000  # its calls, lookahead, one chunk
        seen += [call.task_id for call in page.calls]
        assert all(call.state == "succeeded" and call.attempts == 1 for call in page.calls)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [f"t{n:05d}" for n in range(3000)] and pages == 15
    assert time.perf_counter() - started < 60  # a hang, not a timing: pages are bounded
    assert now > 0
