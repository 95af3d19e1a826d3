"""The Dead letters page in the real Flower, driven by a real headless Chromium.

``celery -A tests.apps.tool_app tooleffect flower`` runs as a subprocess on a
free loopback port; an in-process worker (same broker and key prefix) makes
real dead letters and runs what the page replays. The browser test is skipped,
with the reason, only when no Chromium and chromedriver are installed
(``scripts/services.sh`` installs Debian's ``chromium`` and
``chromium-driver``). The API and authentication tests need no browser.

Set ``TOOLEFFECT_SCREENSHOT=docs/dead-letters.png`` to refresh the README's
screenshot from the browser test.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import DeadLetter, DeadLetters, ToolEffect, ToolTask
from tests.conftest import (
    REDIS_URL,
    TESTS,
    Counter,
    free_port,
    running_worker,
    wait_acknowledged,
    wait_for,
)
from tests.letters import letter_of_call

CHROMIUM = next((path for path in (shutil.which("chromium"), "/usr/bin/chromium",
                                   shutil.which("chromium-browser")) if path
                 and os.path.exists(path)), None)
CHROMEDRIVER = next((path for path in (shutil.which("chromedriver"), "/usr/bin/chromedriver")
                     if path and os.path.exists(path)), None)
NAMES = {
    ToolEffect.READ_ONLY: "tools.read",
    ToolEffect.IDEMPOTENT_WRITE: "tools.idempotent",
    ToolEffect.NON_IDEMPOTENT_WRITE: "tools.write",
}


class TokenRevoked(Exception):
    """The provider refused the tool's credentials (class ``auth``: never retried)."""

    failure_class = "auth"


@dataclass
class FlowerProcess:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@pytest.fixture
def start_flower(prefix: str, tmp_path: Path) -> Iterator[Callable[..., FlowerProcess]]:
    """Start ``celery -A tests.apps.tool_app tooleffect flower`` on a free port."""
    started: list[FlowerProcess] = []

    def start(*flower_args: str, **env: str) -> FlowerProcess:
        port = free_port()
        log = tmp_path / f"flower-{port}.log"
        environment = dict(os.environ)
        environment.update(TE_PREFIX=prefix, TE_BROKER=REDIS_URL,
                           PYTHONPATH=str(TESTS.parent), **env)
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect",
             "flower", f"--port={port}", "--address=127.0.0.1", *flower_args],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=environment,
            cwd=str(TESTS.parent), start_new_session=True,
        )
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


def _answers(flower: FlowerProcess) -> bool:
    try:
        with urllib.request.urlopen(f"{flower.url}/healthcheck", timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class Tools:
    app: Celery
    counter: Counter
    client: redis.Redis
    prefix: str

    def fix(self, key: str) -> None:
        self.client.set(f"{self.prefix}fixed:{key}", "1")

    def dead_letter(self, effect: ToolEffect, key: str) -> DeadLetter:
        result = self.app.send_task(NAMES[effect], args=[key],
                                    headers={"tooleffect_run_id": f"run-{key}"})
        letter = wait_for(lambda: DeadLetters(self.app).get(result.id), what=f"letter {key}")
        wait_acknowledged(self.client, self.prefix)
        return letter


@pytest.fixture
def tools(make_app: Callable[..., Celery], counter: Counter, main_redis: redis.Redis,
          prefix: str) -> Tools:
    """tests/apps/tool_app.py's tool names, failing with an AUTH error until fixed."""
    app = make_app(worker_send_task_events=True, task_send_sent_event=True)

    def body(key: str, hold: float = 0.0) -> str:
        counter.hit(key)
        if not main_redis.exists(f"{prefix}fixed:{key}"):
            raise TokenRevoked(f"the provider revoked the token used for {key}")
        return f"done:{key}"

    for effect, name in NAMES.items():
        app.task(base=ToolTask, effect=effect, name=name, shared=False)(body)
    return Tools(app, counter, main_redis, prefix)


def succeeded(app: Celery, task_id: str) -> None:
    wait_for(lambda: app.AsyncResult(task_id).state == "SUCCESS", what=f"{task_id} to succeed")


# -- the browser ----------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no Chromium or chromedriver here: install Debian's chromium and "
                    "chromium-driver (scripts/services.sh does, as root) to run the browser "
                    "test")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (it is in the dev extra)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless", "--no-sandbox", "--disable-gpu",
                     "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                     "--window-size=1440,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def text_of(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def wait_css(driver: Any, css: str, timeout: float = 15) -> Any:
    from selenium.webdriver.common.by import By

    return wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, css), timeout=timeout,
                    what=f"{css} on {driver.current_url}")[0]


def click(driver: Any, css: str) -> None:
    """Scroll ``css`` to the middle of the window at once (Bootstrap scrolls smoothly, and
    the sticky navbar covers the top) and click it."""
    from selenium.webdriver.common.by import By

    element = driver.find_element(By.CSS_SELECTOR, css)
    driver.execute_script(
        "arguments[0].scrollIntoView({block: 'center', behavior: 'instant'});", element
    )
    element.click()


def outcome(driver: Any) -> str | None:
    """The page's ``#result`` outcome, or None while there is none (or it is being replaced)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    try:
        return driver.find_element(By.CSS_SELECTOR, "#result").get_attribute("data-outcome")
    except WebDriverException:
        return None


def test_dead_letters_page_in_a_real_browser(
    tools: Tools, start_flower: Callable[..., FlowerProcess], browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    app = tools.app
    flower = start_flower()  # first, so that it sees the task-failed events
    with running_worker(app):
        # Flower subscribes to the events after its web server is up: wait until
        # it has seen a task, so that it cannot miss the task-failed events below.
        # A probe that ended before Flower subscribed is never seen (on a busy
        # machine, e.g. beside other tests under pytest-xdist, that happens), so
        # each poll looks for the probe of the poll before and sends a new one.
        tools.fix("page-probe")
        probes: list[str] = []

        def flower_knows_a_probe() -> bool:
            if probes:
                browser.get(f"{flower.url}/task/{probes[-1]}")
                if "Unknown task" not in browser.page_source and probes[-1] in browser.page_source:
                    return True
            probe = app.send_task(NAMES[ToolEffect.READ_ONLY], args=["page-probe"])
            succeeded(app, probe.id)
            probes.append(probe.id)
            return False
        wait_for(flower_knows_a_probe, timeout=20, interval=0.5,
                 what="Flower to receive task events")
        read = tools.dead_letter(ToolEffect.READ_ONLY, "page-read")
        idem = tools.dead_letter(ToolEffect.IDEMPOTENT_WRITE, "page-idem")
        write = tools.dead_letter(ToolEffect.NON_IDEMPOTENT_WRITE, "page-write")

        # The tab is in Flower's own navigation, on Flower's own pages too.
        browser.get(f"{flower.url}/workers")
        wait_css(browser, "#nav-dead-letters").click()
        wait_css(browser, "#dead-letters-table")
        assert browser.current_url.endswith("/dead-letters")
        rows = browser.find_elements(By.CSS_SELECTOR, "tr.dead-letter-row")
        assert [row.get_attribute("data-task-id") for row in rows] == [
            write.task_id, idem.task_id, read.task_id]
        assert "auth" in rows[0].text and "not_retryable" in rows[0].text
        assert "3 in all" in text_of(browser, "#dlq-total")
        screenshot = os.environ.get("TOOLEFFECT_SCREENSHOT")
        if screenshot:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(screenshot)

        # Filters and paging.
        browser.get(f"{flower.url}/dead-letters?effect=idempotent_write")
        rows = browser.find_elements(By.CSS_SELECTOR, "tr.dead-letter-row")
        assert [row.get_attribute("data-task-id") for row in rows] == [idem.task_id]
        browser.get(f"{flower.url}/dead-letters?limit=2")
        assert len(browser.find_elements(By.CSS_SELECTOR, "tr.dead-letter-row")) == 2
        wait_css(browser, "#page-older").click()
        rows = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "tr.dead-letter-row"),
                        what="the older page")
        assert [row.get_attribute("data-task-id") for row in rows] == [read.task_id]
        assert browser.find_elements(By.CSS_SELECTOR, "#page-newest")

        # Replay an IDEMPOTENT_WRITE from its page: it runs again and succeeds.
        browser.get(f"{flower.url}/dead-letters")
        browser.find_element(
            By.CSS_SELECTOR, f"tr[data-task-id='{idem.task_id}'] a.dead-letter-link").click()
        wait_css(browser, "#replay-button")
        assert not browser.find_elements(By.CSS_SELECTOR, "#replay-confirm")
        tools.fix("page-idem")
        browser.find_element(By.CSS_SELECTOR, "#replay-reason").send_keys("token rotated")
        click(browser, "#replay-button")
        result = wait_css(browser, "#result")
        assert result.get_attribute("data-outcome") == "done", result.text
        assert f"replayed tools.idempotent[{idem.task_id}]" in result.text
        succeeded(app, idem.task_id)
        assert tools.counter.value("page-idem") == 2
        assert DeadLetters(app).get(idem.task_id) is None

        # A NON_IDEMPOTENT_WRITE without the confirmation: refused, nothing runs.
        browser.get(f"{flower.url}/dead-letters/{write.task_id}")
        wait_css(browser, "#replay-confirm")
        # Its tool declares no reconcile, and it was not interrupted: no Reconcile.
        assert not browser.find_elements(By.CSS_SELECTOR, "#reconcile-button")
        assert "NON_IDEMPOTENT_WRITE" in text_of(browser, "#replay-rule")
        tools.fix("page-write")
        browser.find_element(By.CSS_SELECTOR, "#replay-reason").send_keys("checked by hand")
        click(browser, "#replay-button")
        result = wait_css(browser, "#result")
        assert result.get_attribute("data-outcome") == "refused", result.text
        assert "NON_IDEMPOTENT_WRITE" in result.text
        assert "tick the confirmation" in result.text
        assert DeadLetters(app).get(write.task_id) is not None
        assert tools.counter.value("page-write") == 1

        # Confirmed, with a reason: replayed once, by whoever is logged in.
        browser.find_element(By.CSS_SELECTOR, "#replay-reason").send_keys("checked by hand")
        click(browser, "#replay-confirm")
        click(browser, "#replay-button")
        wait_for(lambda: outcome(browser) == "done", what="the confirmed replay")
        succeeded(app, write.task_id)
    assert tools.counter.value("page-write") == 2
    events = [event for event in _events(app, write.run_id) if event["phase"] == "replayed"]
    assert len(events) == 1 and events[0]["forced"] == "1"
    assert events[0]["actor"].startswith("anonymous (flower ")
    assert events[0]["via"] == "flower"

    # Flower's task page shows the failure class of a failed tool task.
    def failure_class_row() -> bool:
        browser.get(f"{flower.url}/task/{read.task_id}")
        return "Failure class" in browser.page_source
    wait_for(failure_class_row, timeout=20, interval=0.5, what="the Failure class row")
    row = [element.text for element in browser.find_elements(By.CSS_SELECTOR, ".detail-row")
           if element.text.startswith("Failure class")]
    assert row and row[0].split() == ["Failure", "class", "auth"], row
    # Its exception is the tool's own error; the page says it is a dead letter.
    row = [element.text for element in browser.find_elements(By.CSS_SELECTOR, ".detail-row")
           if element.text.startswith("Dead letter reason")]
    assert row and row[0].split() == ["Dead", "letter", "reason", "not_retryable"], row


def test_the_reconcile_button_settles_a_write_that_happened(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., Any],
    start_flower: Callable[..., FlowerProcess], browser: Any, counter: Counter,
    main_redis: redis.Redis, prefix: str,
) -> None:
    """tools.charge (tests/apps/tool_app.py) killed after it charged, its reconcile
    unsure the first time: a dead letter, which the page's Reconcile settles."""
    app = make_app()
    worker = spawn_worker(concurrency=1)
    key = uuid.uuid4().hex[:8]
    result = app.send_task("tools.charge", args=[key, 60, "after", "unknown_once"],
                           queue="tools")
    child = wait_for(lambda: main_redis.lrange(f"{prefix}started:{key}", 0, -1),
                     what="the body to start")[0]
    os.kill(int(child), signal.SIGKILL)
    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                      what="the dead letter\n" + worker.output()[-3000:])
    assert letter.reason == "interrupted_write"

    flower = start_flower()
    browser.get(f"{flower.url}/dead-letters/{result.id}")
    wait_css(browser, "#reconcile-button")
    click(browser, "#reconcile-button")
    shown = wait_css(browser, "#result")
    assert shown.get_attribute("data-outcome") == "done", shown.text
    assert "applied" in shown.text
    assert DeadLetters(app).get(result.id) is None
    assert app.AsyncResult(result.id).get(timeout=10) == f"ch-{key}-1"
    assert counter.value(key) == 1
    reconciled = [e for e in _events(app, result.id) if e["phase"] == "reconcile"]
    assert [(e["status"], e.get("via")) for e in reconciled] == [
        ("unknown", None), ("applied", "flower")]


def _events(app: Celery, run_id: str) -> list[dict[str, str]]:
    from celery_tooleffect import AuditLog

    return AuditLog(app).events(run_id)


# -- the API and authentication (no browser) -------------------------------------------


def _request(url: str, *, method: str = "GET", body: dict[str, Any] | None = None,
             user: str | None = None, headers: dict[str, str] | None = None
             ) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if user:
        request.add_header("Authorization", "Basic " + base64.b64encode(user.encode()).decode())
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def _store(app: Celery, effect: ToolEffect, key: str) -> DeadLetter:
    letter = letter_of_call(
        app, task_id=f"{key}-{uuid.uuid4().hex[:6]}", name=NAMES[effect], args=[key],
        run_id=f"run-{key}", reason="not_retryable", failure_class="auth",
        effect=effect.value, exception_type="TokenRevoked", attempts=1,
    )
    assert DeadLetters(app).store(letter)
    return letter


def test_api_follows_flowers_basic_auth_and_the_replay_rules(
    tools: Tools, start_flower: Callable[..., FlowerProcess]
) -> None:
    app = tools.app
    idem = _store(app, ToolEffect.IDEMPOTENT_WRITE, "api-idem")
    write = _store(app, ToolEffect.NON_IDEMPOTENT_WRITE, "api-write")
    flower = start_flower("--basic-auth=ops:s3cret")
    ops = "ops:s3cret"

    assert _request(f"{flower.url}/api/dead-letters")[0] == 401
    assert _request(f"{flower.url}/dead-letters")[0] == 401
    assert _request(f"{flower.url}/api/dead-letters", user="ops:wrong")[0] == 401

    status, body = _request(f"{flower.url}/api/dead-letters?effect=idempotent_write", user=ops)
    assert status == 200, body
    listed = json.loads(body)
    assert set(listed) == {"dead_letters", "next_cursor", "total"}
    assert [entry["task_id"] for entry in listed["dead_letters"]] == [idem.task_id]
    assert "args" not in listed["dead_letters"][0]  # metadata privacy: sizes only

    status, body = _request(f"{flower.url}/api/dead-letters/stats", user=ops)
    assert status == 200 and json.loads(body)["by_effect"] == {
        "idempotent_write": 1, "non_idempotent_write": 1}
    status, body = _request(f"{flower.url}/api/dead-letters/{write.task_id}", user=ops)
    assert status == 200 and json.loads(body)["replay"]["needs_force"] is True
    assert _request(f"{flower.url}/api/dead-letters/nope", user=ops)[0] == 404
    assert _request(f"{flower.url}/api/dead-letters?effect=bogus", user=ops)[0] == 400

    # The dead-letter reason filters as dead_letter_reason; reason is only ever
    # the operator's why (replay, purge), so a list asking for it is refused.
    def listed_ids(query: str) -> list[str]:
        status, body = _request(f"{flower.url}/api/dead-letters?{query}", user=ops)
        assert status == 200, body
        return [entry["task_id"] for entry in json.loads(body)["dead_letters"]]

    assert listed_ids("dead_letter_reason=not_retryable&effect=idempotent_write") == [
        idem.task_id]
    assert listed_ids("dead_letter_reason=unknown_task") == []
    assert listed_ids("reason=") == [write.task_id, idem.task_id]
    assert _request(f"{flower.url}/api/dead-letters?reason=not_retryable", user=ops)[0] == 400
    assert _request(f"{flower.url}/api/dead-letters?dead_letter_reason=bored",
                    user=ops)[0] == 400
    assert _request(f"{flower.url}/dead-letters?reason=not_retryable", user=ops)[0] == 400
    # The page's filter and its paging links keep the filter under its name.
    status, page = _request(f"{flower.url}/dead-letters?dead_letter_reason=not_retryable"
                            "&limit=1", user=ops)
    assert status == 200, page
    assert 'name="dead_letter_reason"' in page and 'name="reason"' not in page
    assert "&dead_letter_reason=not_retryable&failure_class=" in page

    # A cross-site POST is refused (more in tests/test_flower_xsrf.py).
    status, _ = _request(f"{flower.url}/api/dead-letters/{idem.task_id}/replay", method="POST",
                         body={}, user=ops, headers={"Sec-Fetch-Site": "cross-site"})
    assert status == 403
    assert DeadLetters(app).get(idem.task_id) is not None

    status, body = _request(f"{flower.url}/api/dead-letters/{write.task_id}/replay",
                            method="POST", body={}, user=ops)
    assert status == 409 and json.loads(body)["outcome"] == "refused"
    status, body = _request(f"{flower.url}/api/dead-letters/{write.task_id}/replay",
                            method="POST", body={"force": True}, user=ops)
    assert status == 409 and "needs a reason" in json.loads(body)["message"]

    with running_worker(app):
        tools.fix("api-write")
        status, body = _request(f"{flower.url}/api/dead-letters/{write.task_id}/replay",
                                method="POST", body={"force": True, "reason": "verified"},
                                user=ops)
        assert status == 200, body
        succeeded(app, write.task_id)
    replayed = [e for e in _events(app, write.run_id) if e["phase"] == "replayed"]
    assert replayed[0]["actor"].startswith("ops (flower ")
    assert replayed[0]["via"] == "flower-api"

    status, body = _request(f"{flower.url}/api/dead-letters/{idem.task_id}/purge",
                            method="POST", body={"reason": "obsolete"}, user=ops)
    assert status == 200, body
    assert DeadLetters(app).get(idem.task_id) is None
    assert _request(f"{flower.url}/api/dead-letters/{idem.task_id}/purge", method="POST",
                    body={}, user=ops)[0] == 404


def test_api_needs_authentication_or_flowers_opt_out(
    tools: Tools, start_flower: Callable[..., FlowerProcess]
) -> None:
    _store(tools.app, ToolEffect.READ_ONLY, "open")
    closed = start_flower()
    assert _request(f"{closed.url}/api/dead-letters")[0] == 401
    assert _request(f"{closed.url}/dead-letters")[0] == 200  # the page, as Flower's pages
    opened = start_flower(FLOWER_UNAUTHENTICATED_API="true")
    status, body = _request(f"{opened.url}/api/dead-letters")
    assert status == 200 and json.loads(body)["total"] == 1
