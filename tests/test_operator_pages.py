"""What operators see and decide: a call's arguments on its approval (as the
tool shows them to approvers), and a run's calls in order with their timeline,
in the real Flower, the CLI and the store.

A real ``celery -A tests.apps.tool_app worker`` (``spawn_worker``) parks and
runs the calls; Flower is ``celery -A tests.apps.tool_app tooleffect flower``
(tests/test_flower.py's fixture). Set ``TOOLEFFECT_SCREENSHOT=docs/dead-letters.png``
to refresh the docs' screenshots: the browser test writes ``approval-arguments.png``
and ``bulk-replay.png`` beside it (``run.png``: tests/agents/test_run_page.py).
"""

from __future__ import annotations

import hashlib
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
from tests import test_flower_approvals as approvals_tests
from tests.conftest import REDIS_URL, TESTS, Counter, WorkerProcess, wait_for
from tests.letters import letter_of_call
from tests.test_flower import FlowerProcess, _request, click, wait_css

pytestmark = pytest.mark.timeout(240)

start_flower = base.start_flower
# tests/test_flower_approvals.py's app fixture and helper.
app = approvals_tests.app
park = approvals_tests.park
browser = base.browser

USER = "ops:s3cret"
CARD = "4242424242424242"


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


def test_hidden_characters_in_arguments_are_shown_escaped_and_the_digest_is_over_the_values(
    app: Celery, prefix: str, spawn_worker: Callable[..., WorkerProcess],
    start_flower: Callable[..., FlowerProcess], counter: Counter,
) -> None:
    """A right-to-left override (U+202E) and a zero-width space in an argument
    reach no approver raw: the pages, the CLI and the API escape or name them,
    and what is decided (the digest) is still over the values themselves."""
    spawn_worker(concurrency=1)
    flower = start_flower(f"--basic-auth={USER}")
    # Reads "...acct42 0001" where the value ends in "1000".
    key = uuid.uuid4().hex[:8] + "acct\u200b42 \u202e1000"
    call = park(app, "tools.approved_write", key)
    raw = ("\u202e", "\u200b")

    status, body = _request(f"{flower.url}/api/approvals/{call.id}", user=USER)
    assert status == 200, body
    shown = json.loads(body)["shown"]
    assert shown["args"] == [key]  # the values themselves, for a program
    assert shown["invisible"] == ["U+200B ZERO WIDTH SPACE", "U+202E RIGHT-TO-LEFT OVERRIDE"]
    values = json.dumps({"args": [key], "kwargs": {}, "problem": None}, sort_keys=True,
                        ensure_ascii=False, separators=(",", ":"))
    assert shown["digest"] == hashlib.sha256(values.encode()).hexdigest()

    status, page = _request(f"{flower.url}/approvals/{call.id}", user=USER)
    assert status == 200
    assert not any(char in page for char in raw)
    assert "acct\\u200b42 \\u202e1000" in page and 'id="ap-invisible"' in page
    assert "U+202E RIGHT-TO-LEFT OVERRIDE" in page
    status, listing = _request(f"{flower.url}/approvals", user=USER)
    assert status == 200 and not any(char in listing for char in raw)
    assert "\\u202e1000" in listing and "approval-invisible" in listing

    human = cli(prefix, "approvals", "show", call.id)
    assert human.returncode == 0, human.stderr
    assert not any(char in human.stdout for char in raw)
    assert "\\u202e1000" in human.stdout
    assert "warning: the arguments hold 2 kind(s) of invisible" in " ".join(human.stdout.split())
    listed = cli(prefix, "approvals", "list", "--wide")
    assert call.id in listed.stdout and not any(char in listed.stdout for char in raw)
    as_json = cli(prefix, "approvals", "show", call.id, "--json")
    assert not any(char in as_json.stdout for char in raw)
    assert json.loads(as_json.stdout)["shown"]["args"] == [key]  # the same JSON value

    # Deciding on what was shown: the digest is the values'.
    status, body = _request(f"{flower.url}/api/approvals/{call.id}/approve", method="POST",
                            user=USER, body={"reason": "read the escapes",
                                             "shown_digest": shown["digest"]},
                            headers={"Origin": flower.url})
    assert status == 200, body
    assert call.get(timeout=60) == key and counter.value(key) == 1
    assert decision(app, call.id)["shown_digest"] == shown["digest"]


def test_a_dead_letters_hidden_characters_are_shown_escaped(
    app: Celery, prefix: str, start_flower: Callable[..., FlowerProcess],
) -> None:
    """``dlq show`` (text and --json) and the dead letter's page escape them too."""
    key = "refund \u202e0001"
    letter = letter_of_call(app, task_id=f"hidden-{uuid.uuid4().hex[:6]}", name="tools.write",
                            args=[key], kwargs={"note\u2066": "x"}, run_id="run-hidden",
                            reason="not_retryable", failure_class="unknown",
                            effect="non_idempotent_write", exception_type="ValueError",
                            error="ValueError: bad \u202eamount")
    assert DeadLetters(app).store(letter)
    shown = cli(prefix, "dlq", "show", letter.task_id)
    assert shown.returncode == 0, shown.stderr
    assert "\u202e" not in shown.stdout and "\u2066" not in shown.stdout
    assert "refund \\u202e0001" in shown.stdout and "note\\u2066" in shown.stdout
    assert "bad \\u202eamount" in shown.stdout
    as_json = cli(prefix, "dlq", "show", letter.task_id, "--json")
    assert "\u202e" not in as_json.stdout
    assert json.loads(as_json.stdout)["dead_letter"]["args"] == [key]

    flower = start_flower(f"--basic-auth={USER}")
    status, page = _request(f"{flower.url}/dead-letters/{letter.task_id}", user=USER)
    assert status == 200 and "\u202e" not in page and "\u2066" not in page
    assert "refund \\u202e0001" in page and "bad \\u202eamount" in page


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
    assert calls[2]["attempts"] == calls[2]["bodies"] == 1
    assert calls[2]["spans"][0]["status"] == "succeeded"
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


# -- bulk actions ---------------------------------------------------------------------------


tools = base.tools


def test_bulk_replay_and_purge_confirm_the_count_and_follow_the_clis_rules(
    tools: Any, start_flower: Callable[..., FlowerProcess],
) -> None:
    from celery_tooleffect import ToolEffect
    from tests.conftest import running_worker
    from tests.test_flower_xsrf import FORM, _form, _post, make_letters

    app = tools.app
    idem, read, write = make_letters(tools, (ToolEffect.IDEMPOTENT_WRITE, "bulk-idem"),
                                     (ToolEffect.READ_ONLY, "bulk-read"),
                                     (ToolEffect.NON_IDEMPOTENT_WRITE, "bulk-write"))
    for key in ("bulk-idem", "bulk-read", "bulk-write"):
        tools.fix(key)
    flower = start_flower(f"--basic-auth={USER}")
    bulk = f"{flower.url}/dead-letters-bulk/replay"

    status, page = _request(f"{flower.url}/dead-letters", user=USER)
    assert status == 200 and 'id="bulk-replay"' in page
    status, page = _request(bulk, user=USER)
    assert status == 200, page
    assert "<strong>3</strong> dead letters match" in page
    assert "1 of them is a NON_IDEMPOTENT_WRITE" in page and "(2 can be)" in page

    # A forged request (no token, another origin) does nothing.
    forged = {"reason": "forged", "confirm": "on"}
    status, body = _post(bulk, _form(forged), content_type=FORM, user=USER)
    assert status == 403 and "'_xsrf' argument missing" in body.replace("&#x27;", "'")
    status, body = _post(f"{flower.url}/api/dead-letters-bulk/replay",
                         json.dumps(forged).encode(), content_type="application/json",
                         user=USER, headers={"Origin": "http://127.0.0.1:1"})
    assert status == 403, body
    assert all(DeadLetters(app).get(letter.task_id) for letter in (idem, read, write))

    # The page's own form: without the confirmation nothing is done; with it, the
    # CLI's --all rules: the NON_IDEMPOTENT_WRITE is refused, the others replayed.
    token = uuid.uuid4().hex
    session = {"Cookie": f"_xsrf={token}", "Origin": flower.url}
    status, body = _post(bulk, _form({"_xsrf": token, "reason": "provider fixed"}),
                         content_type=FORM, user=USER, headers=session)
    assert status == 400 and "Tick the confirmation" in body
    assert all(DeadLetters(app).get(letter.task_id) for letter in (idem, read, write))
    with running_worker(app):
        status, body = _post(bulk, _form({"_xsrf": token, "reason": "provider fixed",
                                          "confirm": "on"}),
                             content_type=FORM, user=USER, headers=session)
        assert status == 200, body
        assert '<span id="bulk-done">2</span>' in body
        assert '<span id="bulk-refused">1</span>' in body
        assert "never in bulk" in body and "--force" not in body  # the page's words
        for letter in (idem, read):
            wait_for(lambda letter=letter: app.AsyncResult(letter.task_id).state == "SUCCESS",
                     timeout=30, what=f"{letter.task_id} to succeed once replayed")
    assert DeadLetters(app).get(write.task_id) is not None
    replayed = [event for event in AuditLog(app).events(idem.run_id)
                if event.get("phase") == "replayed"]
    assert replayed and replayed[-1]["via"] == "flower" and replayed[-1]["reason"] == (
        "provider fixed")

    # The API purges what the filters match, with a reason.
    status, body = _post(f"{flower.url}/api/dead-letters-bulk/purge",
                         json.dumps({"effect": "non_idempotent_write", "older_than": "0s",
                                     "reason": "handled by hand"}).encode(),
                         content_type="application/json", user=USER)
    assert status == 200, body
    assert json.loads(body)["counts"]["done"] == 1
    assert DeadLetters(app).get(write.task_id) is None


# -- the pages in a real browser ---------------------------------------------------------


def _screenshot(browser: Any, name: str) -> None:
    """Refresh the docs' screenshot ``name`` when TOOLEFFECT_SCREENSHOT says where."""
    target = os.environ.get("TOOLEFFECT_SCREENSHOT")
    if target:
        path = Path(target).parent / name
        path.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(path))


def test_the_approval_run_and_bulk_pages_in_a_real_browser(
    app: Celery, spawn_worker: Callable[..., WorkerProcess],
    start_flower: Callable[..., FlowerProcess], browser: Any, counter: Counter,
) -> None:
    from selenium.webdriver.common.by import By

    spawn_worker(concurrency=1)
    key = uuid.uuid4().hex[:8]
    pay = park(app, "tools.pay", key, CARD, 125_000)
    flower = start_flower(FLOWER_UNAUTHENTICATED_API="true")

    # The list shows what approvers may see; the call's page too, and approving it
    # from there records the digest of what the page showed.
    browser.get(f"{flower.url}/approvals")
    row = wait_css(browser, f"tr[data-task-id='{pay.id}']")
    assert "card=\"**** **** **** 4242\"" in row.text and CARD not in browser.page_source
    browser.get(f"{flower.url}/approvals/{pay.id}")
    wait_css(browser, "#approve-button")
    shown = base.text_of(browser, "#ap-arguments")
    assert '"card": "**** **** **** 4242"' in shown and '"amount": "1250.00"' in shown
    assert CARD not in browser.page_source
    _screenshot(browser, "approval-arguments.png")
    browser.find_element(By.CSS_SELECTOR, "#approve-reason").send_keys("card holder called")
    click(browser, "#approve-button")
    wait_for(lambda: base.outcome(browser) == "done", what="the approval")
    assert pay.get(timeout=60) == key and counter.value(key) == 1
    digest = json.loads(_request(f"{flower.url}/api/approvals/{pay.id}")[1])["shown"]["digest"]
    assert decision(app, pay.id)["shown_digest"] == digest

    # The run's page: the approval, then the call; its task id leads to the approval.
    click(browser, "#ap-run")
    wait_css(browser, "#run-timeline")
    rows = browser.find_elements(By.CSS_SELECTOR, "tr.run-call")
    assert [row.get_attribute("data-state") for row in rows] == ["succeeded"]
    assert "tools.pay" in rows[0].text and "approval approved" in rows[0].text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#run-timeline rect.timeline-span")) == 1
    click(browser, "a.call-link")
    wait_css(browser, "#ap-state")
    assert browser.current_url.endswith(f"/approvals/{pay.id}")

    # A bulk replay asks for a confirmation that says what it will and will not do.
    for n in range(2):
        wrong = app.send_task("tools.write", kwargs={"no_such_argument": n}, queue="tools")
        wait_for(lambda wrong=wrong: DeadLetters(app).get(wrong.id), timeout=60,
                 what="a dead letter")
    browser.get(f"{flower.url}/dead-letters")
    click(browser, "#bulk-replay")
    wait_css(browser, "#bulk-form")
    assert base.text_of(browser, "#bulk-count") == "2 dead letters match."
    assert base.text_of(browser, "#bulk-non-idempotent").startswith(
        "2 of them are NON_IDEMPOTENT_WRITEs")
    browser.find_element(By.CSS_SELECTOR, "#bulk-reason").send_keys("fixed the producer")
    _screenshot(browser, "bulk-replay.png")
    click(browser, "#bulk-confirm")
    click(browser, "#bulk-button")
    wait_css(browser, "#bulk-done")
    assert base.text_of(browser, "#bulk-done") == "0"
    assert base.text_of(browser, "#bulk-refused") == "2"


def test_the_pages_in_an_existing_flower_under_its_url_prefix_and_basic_auth(
    app: Celery, prefix: str, tmp_path: Path, spawn_worker: Callable[..., WorkerProcess],
    browser: Any,
) -> None:
    """``celery flower`` (Flower's own command) with a configuration file that
    calls ``install()``, and sets Flower's basic auth and URL prefix there."""
    from selenium.webdriver.common.by import By

    from tests.conftest import free_port
    from tests.test_flower import _answers

    spawn_worker(concurrency=1)
    wrong = app.send_task("tools.write", kwargs={"no_such_argument": 1}, queue="tools")
    wait_for(lambda: DeadLetters(app).get(wrong.id), timeout=60, what="a dead letter")
    config = tmp_path / "flowerconfig.py"
    config.write_text("from celery_tooleffect.admin.flower.app import install\n"
                      "install()\n"
                      f"basic_auth = [{USER!r}]\n"
                      "url_prefix = 'ops/flower'\n")
    port = free_port()
    env = {**os.environ, "TE_PREFIX": prefix, "TE_BROKER": REDIS_URL,
           "PYTHONPATH": str(TESTS.parent)}
    log = (tmp_path / "flower.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "flower",
         f"--conf={config}", f"--port={port}", "--address=127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
        start_new_session=True)
    try:
        root = f"http://127.0.0.1:{port}/ops/flower"
        flower = FlowerProcess(root, process, tmp_path / "flower.log")
        wait_for(lambda: _answers(flower) or process.poll() is not None, timeout=40,
                 what="Flower to answer")
        assert process.poll() is None, flower.output()
        assert _request(f"{root}/dead-letters")[0] == 401
        status, body = _request(f"{root}/api/dead-letters", user=USER)
        assert status == 200 and wrong.id in body
        status, body = _request(f"{root}/api/runs/{wrong.id}", user=USER)
        assert status == 200 and json.loads(body)["calls"][0]["task_id"] == wrong.id

        browser.get(f"http://{USER}@127.0.0.1:{port}/ops/flower/workers")
        wait_css(browser, "#nav-dead-letters").click()
        row = wait_css(browser, f"tr[data-task-id='{wrong.id}']")
        assert "tools.write" in row.text
        assert browser.current_url.endswith(f":{port}/ops/flower/dead-letters")
        row.find_element(By.CSS_SELECTOR, "a.dead-letter-link").click()
        wait_css(browser, "#dl-run").click()
        wait_css(browser, "#run-calls")
        assert browser.current_url.endswith(f":{port}/ops/flower/runs/{wrong.id}")
    finally:
        os.killpg(process.pid, 9)
        process.wait(10)
