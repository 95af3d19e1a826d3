"""The Approvals page, its JSON API and the ``tooleffect_approvals_pending`` gauge,
in the real Flower.

A real ``celery -A tests.apps.tool_app worker`` (``spawn_worker``) parks the calls
of ``tools.approved_write`` (every call needs approval) and ``tools.refund`` (refunds
above 100 do); ``celery -A tests.apps.tool_app tooleffect flower`` runs as a
subprocess on the same key prefix. Every decision is taken through Flower (the
API, or the page in a real headless Chromium), and what happened is checked in
the store: the body's side-effect counter, the task's result, the audit trail.

Fixtures (the Flower subprocess, the browser) and helpers are tests/test_flower.py's.
Set ``TOOLEFFECT_SCREENSHOT=docs/dead-letters.png`` to refresh the docs' screenshots:
the browser test here writes ``approvals.png`` beside it.
"""

from __future__ import annotations

import html
import json
import os
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_tooleffect import Approvals, ApprovalState, AuditLog
from tests import test_flower as base
from tests.conftest import Counter, WorkerProcess, wait_for
from tests.test_flower import FlowerProcess, _request, click, outcome, wait_css
from tests.test_flower_xsrf import FORM, _form, _post

pytestmark = pytest.mark.timeout(240)

# tests/test_flower.py's fixtures, under their own names.
start_flower = base.start_flower
browser = base.browser

USER = "ops:s3cret"
WRITE = "tools.approved_write"
REFUND = "tools.refund"
GAUGE = "tooleffect_approvals_pending"


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    return make_app()


def park(app: Celery, name: str, *args: Any) -> Any:
    """Send a call that needs approval to the queue ``tools``; its result once parked."""
    result = app.send_task(name, args=list(args), queue="tools")
    wait_for(lambda: Approvals(app).get(result.id), timeout=60,
             what=f"{name}[{result.id}] to be parked")
    return result


def pending_gauge(flower: FlowerProcess) -> dict[tuple[str, str], float]:
    """The samples of ``tooleffect_approvals_pending`` on Flower's /metrics, by (queue, tool)."""
    status, text = _request(f"{flower.url}/metrics", user=USER)
    assert status == 200, text
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == GAUGE:
            assert family.type == "gauge"
            for sample in family.samples:
                found[(sample.labels["queue"], sample.labels["tool"])] = sample.value
    return found


def decisions(app: Celery, task_id: str) -> list[dict[str, str]]:
    """The decision events of a call (its run id is its task id)."""
    return [event for event in AuditLog(app).events(task_id)
            if event["phase"] == "approval" and event["status"] != "requested"]


def refused(app: Celery, result: Any) -> None:
    """``result`` ended FAILURE with ApprovalRejected, on the worker that received it."""
    wait_for(lambda: result.state == "FAILURE", timeout=60, what=f"{result.id} to end FAILURE")
    assert type(result.result).__name__ == "ApprovalRejected", repr(result.result)


# -- the API and the gauge ---------------------------------------------------------------------


def test_the_api_lists_approves_and_rejects_and_the_gauge_follows(
    app: Celery, spawn_worker: Callable[..., WorkerProcess],
    start_flower: Callable[..., FlowerProcess], counter: Counter,
) -> None:
    spawn_worker(concurrency=1)
    flower = start_flower(f"--basic-auth={USER}")
    api = f"{flower.url}/api/approvals"
    key, refund_key = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    write = park(app, WRITE, key)
    refund = park(app, REFUND, refund_key, 500)

    # Flower's authentication, as for the dead letters.
    assert _request(api)[0] == 401
    assert _request(f"{flower.url}/approvals")[0] == 401
    assert _request(api, user="ops:wrong")[0] == 401

    def listed(query: str = "") -> dict[str, Any]:
        status, body = _request(f"{api}?{query}", user=USER)
        assert status == 200, body
        return dict(json.loads(body))

    everything = listed()
    assert set(everything) == {"approvals", "count", "next_offset", "total"}
    assert [entry["task_id"] for entry in everything["approvals"]] == [write.id, refund.id]
    assert everything["count"] == everything["total"] == 2
    assert everything["next_offset"] is None
    first = everything["approvals"][0]
    assert (first["name"], first["queue"], first["state"]) == (WRITE, "tools", "pending")
    assert first["arguments"] == {"args_size": str(len(json.dumps([key]))), "kwargs_size": "2"}
    assert "message" not in first

    # Filters and paging.
    assert [e["task_id"] for e in listed(f"tool={REFUND}")["approvals"]] == [refund.id]
    assert [e["task_id"] for e in listed("queue=tools&state=pending")["approvals"]] == [
        write.id, refund.id]
    assert listed("queue=elsewhere") == {"approvals": [], "count": 0, "next_offset": None,
                                         "total": 0}
    assert listed("state=approved")["approvals"] == []
    page = listed("limit=1")
    assert [e["task_id"] for e in page["approvals"]] == [write.id]
    assert (page["count"], page["next_offset"], page["total"]) == (1, 1, 2)
    page = listed(f"limit=1&offset={page['next_offset']}")
    assert [e["task_id"] for e in page["approvals"]] == [refund.id]
    assert page["next_offset"] is None
    for bad in ("state=bogus", "offset=x", "limit=x"):
        assert _request(f"{api}?{bad}", user=USER)[0] == 400, bad

    # One call, the counts, and the gauge while both are parked.
    status, body = _request(f"{api}/{write.id}", user=USER)
    assert status == 200 and json.loads(body)["state"] == "pending", body
    assert _request(f"{api}/nope", user=USER)[0] == 404
    status, body = _request(f"{api}/stats", user=USER)
    assert status == 200, body
    stats = json.loads(body)
    assert stats["pending"] == 2 and stats["by_tool"] == {WRITE: 1, REFUND: 1}
    assert stats["by_queue_and_tool"] == [
        {"queue": "tools", "tool": WRITE, "pending": 1},
        {"queue": "tools", "tool": REFUND, "pending": 1}]
    assert pending_gauge(flower) == {("tools", WRITE): 1.0, ("tools", REFUND): 1.0}
    assert counter.value(key) == 0 and counter.value(refund_key) == 0

    # Approve: the body runs once, and the decision is in the audit trail with who and why.
    status, body = _request(f"{api}/{write.id}/approve", method="POST",
                            body={"reason": "checked with the customer"}, user=USER)
    assert status == 200, body
    assert json.loads(body)["outcome"] == "done" and json.loads(body)["action"] == "approve"
    assert write.get(timeout=60) == key
    assert counter.value(key) == 1
    [approved] = decisions(app, write.id)
    assert approved["status"] == "approved"
    assert approved["actor"].startswith("ops (flower ") and approved["via"] == "flower"
    assert approved["reason"] == "checked with the customer"
    assert pending_gauge(flower).get(("tools", WRITE), 0.0) == 0.0
    assert pending_gauge(flower)[("tools", REFUND)] == 1.0

    # A second decision is refused, and changes nothing.
    for verb in ("approve", "reject"):
        status, body = _request(f"{api}/{write.id}/{verb}", method="POST",
                                body={"reason": "again"}, user=USER)
        assert status == 409, body
        assert "decided already: approved by ops (flower " in json.loads(body)["message"]
    assert Approvals(app).get(write.id).state is ApprovalState.APPROVED
    assert len(decisions(app, write.id)) == 1 and counter.value(key) == 1

    # Reject: refused without a reason (nothing decided), then with one: FAILURE, nothing ran.
    status, body = _request(f"{api}/{refund.id}/reject", method="POST", body={}, user=USER)
    assert status == 409 and "needs a reason" in json.loads(body)["message"], body
    assert Approvals(app).get(refund.id).state is ApprovalState.PENDING
    status, body = _request(f"{api}/{refund.id}/reject", method="POST",
                            body={"reason": "duplicate refund"}, user=USER)
    assert status == 200 and json.loads(body)["outcome"] == "done", body
    refused(app, refund)
    assert "by ops (flower " in str(refund.result) and "duplicate refund" in str(refund.result)
    assert counter.value(refund_key) == 0
    [rejected] = decisions(app, refund.id)
    assert (rejected["status"], rejected["reason"]) == ("rejected", "duplicate refund")
    assert rejected["actor"].startswith("ops (flower ")
    status, body = _request(f"{api}/{refund.id}/approve", method="POST", body={}, user=USER)
    assert status == 409, body
    assert counter.value(refund_key) == 0

    assert _request(f"{api}/nope/approve", method="POST", body={}, user=USER)[0] == 404
    assert listed() == {"approvals": [], "count": 0, "next_offset": None, "total": 0}
    assert pending_gauge(flower) == {}


def test_decisions_follow_the_dead_letter_request_checks(
    app: Celery, spawn_worker: Callable[..., WorkerProcess],
    start_flower: Callable[..., FlowerProcess], counter: Counter,
) -> None:
    """Without authentication (Flower checks nothing there), the package's own checks:
    no decision from another origin, none from a form without the page's token, none
    from the API without a JSON body."""
    spawn_worker(concurrency=1)
    flower = start_flower(FLOWER_UNAUTHENTICATED_API="true")
    key = uuid.uuid4().hex[:8]
    write = park(app, WRITE, key)
    page, api = f"{flower.url}/approvals/{write.id}", f"{flower.url}/api/approvals/{write.id}"
    forged = {"reason": "forged"}

    for verb in ("approve", "reject"):
        status, body = _post(f"{page}/{verb}", _form(forged), content_type=FORM, user=None)
        assert status == 403 and "'_xsrf' argument missing" in html.unescape(body), body
        token = uuid.uuid4().hex
        status, body = _post(f"{page}/{verb}", _form({**forged, "_xsrf": token}),
                             content_type=FORM, user=None,
                             headers={"Cookie": f"_xsrf={token}",
                                      "Origin": "http://127.0.0.1:1"})
        assert status == 403 and "Cross-origin request refused" in body, body
        lookalike = json.dumps(forged).encode()
        for data, content_type, expected in [
            (_form(forged), FORM, 415), (lookalike, "text/plain", 415), (lookalike, None, 415),
            (b"[]", "application/json", 400), (b"{not json", "application/json", 400),
        ]:
            status, body = _post(f"{api}/{verb}", data, content_type=content_type, user=None)
            assert status == expected, (verb, content_type, status, body)
        status, body = _post(f"{api}/{verb}", lookalike, content_type="application/json",
                             user=None, headers={"Sec-Fetch-Site": "cross-site"})
        assert status == 403 and "Cross-origin request refused" in body, body
    assert Approvals(app).get(write.id).state is ApprovalState.PENDING
    assert decisions(app, write.id) == []

    # The page's own token (cookie and field, as a browser sends them back) is accepted.
    with urllib.request.urlopen(page, timeout=20) as response:
        cookie = response.headers["Set-Cookie"].split(";", 1)[0]
        fields = response.read().decode()
    token = html.unescape(fields.split('name="_xsrf" value="', 1)[1].split('"', 1)[0])
    status, body = _post(f"{page}/approve", _form({"_xsrf": token, "reason": "ok"}),
                         content_type=FORM, user=None,
                         headers={"Cookie": cookie, "Sec-Fetch-Site": "same-origin"})
    assert status == 200 and 'data-outcome="done"' in body, body
    assert write.get(timeout=60) == key and counter.value(key) == 1
    [approved] = decisions(app, write.id)
    assert approved["actor"].startswith("anonymous (flower ")


# -- the page, in a real browser --------------------------------------------------------------


def test_approvals_page_in_a_real_browser(
    app: Celery, spawn_worker: Callable[..., WorkerProcess],
    start_flower: Callable[..., FlowerProcess], browser: Any, counter: Counter,
) -> None:
    from selenium.webdriver.common.by import By

    spawn_worker(concurrency=1)
    key = f"refund-{uuid.uuid4().hex[:6]}"
    write = park(app, REFUND, key, 250)
    flower = start_flower()

    # The tab is in Flower's own navigation, beside Dead letters.
    browser.get(f"{flower.url}/workers")
    tabs = [element.get_attribute("id") for element in
            browser.find_elements(By.CSS_SELECTOR, ".app-nav .nav-link[id^='nav-']")]
    assert tabs[-2:] == ["nav-dead-letters", "nav-approvals"], tabs
    wait_css(browser, "#nav-approvals").click()
    wait_css(browser, "#approvals-table")
    assert browser.current_url.endswith("/approvals")
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.approval-row")
    assert [row.get_attribute("data-task-id") for row in rows] == [write.id]
    assert REFUND in rows[0].text and "tools" in rows[0].text and "pending" in rows[0].text
    # The call's arguments, decoded from its kept message (not the audit's sizes).
    assert f'"{key}"' in rows[0].text and "250" in rows[0].text
    assert "1 pending" in base.text_of(browser, "#approvals-pending")
    screenshot = os.environ.get("TOOLEFFECT_SCREENSHOT")
    if screenshot:
        target = Path(screenshot).parent / "approvals.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(target))

    # The filters.
    browser.get(f"{flower.url}/approvals?tool={urllib.parse.quote(WRITE)}")
    wait_css(browser, "#approvals-table")
    assert not browser.find_elements(By.CSS_SELECTOR, "tr.approval-row")
    browser.get(f"{flower.url}/approvals?queue=tools&tool={urllib.parse.quote(REFUND)}")
    wait_css(browser, "#approvals-table")
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.approval-row")) == 1

    # Approve it from its page, with a reason: it runs once, and the page shows who decided.
    browser.find_element(By.CSS_SELECTOR, f"tr[data-task-id='{write.id}'] a.approval-link").click()
    wait_css(browser, "#approve-button")
    assert base.text_of(browser, "#ap-state") == "pending"
    browser.find_element(By.CSS_SELECTOR, "#approve-reason").send_keys("ticket 4521")
    click(browser, "#approve-button")
    wait_for(lambda: outcome(browser) == "done", what="the approval")
    assert f"{REFUND}[{write.id}] approved" in base.text_of(browser, "#result")
    assert write.get(timeout=60) == 250
    assert counter.value(key) == 1
    [approved] = decisions(app, write.id)
    assert approved["status"] == "approved" and approved["reason"] == "ticket 4521"
    assert approved["actor"].startswith("anonymous (flower ")
    assert base.text_of(browser, "#ap-state") == "approved"
    assert base.text_of(browser, "#ap-decided-by") == approved["actor"]
    assert not browser.find_elements(By.CSS_SELECTOR, "#approve-button")
    trail = [row.text for row in browser.find_elements(By.CSS_SELECTOR, "tr.audit-row")]
    assert any("approved" in row and "ticket 4521" in row and "anonymous" in row
               for row in trail), trail

    # Reject another from its page: the form needs a reason (the API refuses a rejection
    # without one too); then it ends FAILURE and nothing of it runs.
    other = f"refund-{uuid.uuid4().hex[:6]}"
    second = park(app, REFUND, other, 900)
    browser.get(f"{flower.url}/approvals/{second.id}")
    wait_css(browser, "#reject-button")
    assert browser.execute_script(
        "return document.querySelector('#reject-reason').validity.valueMissing") is True
    browser.find_element(By.CSS_SELECTOR, "#reject-reason").send_keys("over the limit")
    click(browser, "#reject-button")
    wait_for(lambda: outcome(browser) == "done", what="the rejection")
    refused(app, second)
    assert counter.value(other) == 0
    [rejected] = decisions(app, second.id)
    assert (rejected["status"], rejected["reason"]) == ("rejected", "over the limit")

    browser.get(f"{flower.url}/approvals")
    wait_css(browser, "#approvals-table")
    assert not browser.find_elements(By.CSS_SELECTOR, "tr.approval-row")
