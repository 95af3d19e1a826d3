"""Cross-site request forgery against the Dead letters page and API, in the real Flower.

A page served from ANOTHER origin (a small ``http.server`` on another loopback
port) submits forms (form-encoded, multipart, and ``text/plain`` bodies that
look like JSON) to the page's and the API's replay and purge URLs, in a real
headless Chromium that holds the operator's basic-auth credentials (loaded
once as ``http://user:pass@host/``, so the browser sends them with the forged
requests, as it would for any other site). Every one is refused and the
letters are still there. The same with a Flower without authentication (its
page is open, and Flower 2.2 checks nothing there), where a planted ``_xsrf``
cookie (same host, other port: cookies ignore ports) and a CORS ``fetch`` of a
JSON body are tried too. Plain HTTP requests check the rules themselves: no
``_xsrf`` token, no page action; no ``application/json``, no API action. And
the page's own forms and JSON API calls still work.

Fixtures (Flower subprocess, the in-process tools app, the browser) are
tests/test_flower.py's.
"""

from __future__ import annotations

import base64
import html
import http.client
import http.server
import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from celery_tooleffect import DeadLetter, DeadLetters, ToolEffect
from tests import test_flower as base
from tests.conftest import free_port, running_worker, wait_for
from tests.test_flower import FlowerProcess, Tools, _events, outcome, wait_css

# tests/test_flower.py's fixtures, under their own names.
start_flower = base.start_flower
tools = base.tools
browser = base.browser

USER = "ops:s3cret"
#: How this package (or, under --basic-auth, Flower 2.2 first) refuses a browser's
#: cross-origin POST (the page renders it, the API writes it).
REFUSALS = ("Cross-origin request refused", "Cross-site request forbidden",
            "Cross-origin request forbidden")


# -- another origin ----------------------------------------------------------------------


@dataclass
class Attacker:
    """A web server on another port of 127.0.0.1: another origin than Flower's."""

    url: str
    pages: dict[str, str] = field(default_factory=dict)

    def serve(self, html_text: str) -> str:
        path = f"/{uuid.uuid4().hex}.html"
        self.pages[path] = html_text
        return self.url + path


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    site = Attacker(f"http://127.0.0.1:{free_port()}")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            page = site.pages.get(self.path.split("?", 1)[0])
            body = (page or "not here").encode()
            self.send_response(200 if page is not None else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    port = int(site.url.rsplit(":", 1)[1])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield site
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def form_page(action: str, fields: dict[str, str], *, enctype: str = "", method: str = "post",
              cookie: str = "") -> str:
    """A page that submits one form to ``action`` as soon as it is parsed."""
    inputs = "".join(
        f'<input type="hidden" name="{html.escape(name)}" value="{html.escape(value)}">'
        for name, value in fields.items())
    enctype_attribute = f' enctype="{enctype}"' if enctype else ""
    plant = f"document.cookie = {json.dumps(cookie)};" if cookie else ""
    return (f'<!doctype html><html><body><h1>Cute cats</h1>'
            f'<form id="forged" method="{method}" action="{html.escape(action)}"'
            f'{enctype_attribute}>{inputs}</form>'
            f'<script>{plant}document.getElementById("forged").submit();</script>'
            f'</body></html>')


def json_lookalike(body: dict[str, Any]) -> dict[str, str]:
    """One ``text/plain`` form field whose submitted body (``name=value``) parses as JSON."""
    text = json.dumps(body)
    return {text[:-1] + ', "pad": "': '"}'}


def fetch_page(url: str, body: str) -> str:
    """A page whose script POSTs ``body`` as ``application/json`` to ``url`` (CORS)."""
    return ("<!doctype html><html><body><script>"
            f"fetch({json.dumps(url)}, {{method: 'POST', body: {json.dumps(body)}, "
            "headers: {'Content-Type': 'application/json'}})"
            ".then(r => { window.forged = 'status ' + r.status; },"
            "      e => { window.forged = 'blocked ' + e; });"
            "</script></body></html>")


def land(driver: Any, flower: FlowerProcess, page_url: str) -> str:
    """Open ``page_url``, wait until its forged request has landed on Flower; its text."""
    from selenium.webdriver.common.by import By

    driver.get(page_url)

    def landed() -> str | None:
        if not driver.current_url.startswith(flower.url):
            return None
        if driver.execute_script("return document.readyState") != "complete":
            return None
        return str(driver.find_element(By.TAG_NAME, "body").text) or None

    return str(wait_for(landed, timeout=20, what=f"the forged request of {page_url}"))


def cache_credentials(driver: Any, flower: FlowerProcess) -> None:
    """Log the browser in as an operator does: it keeps the credentials for Flower's origin."""
    driver.get(flower.url.replace("http://", f"http://{USER}@") + "/dead-letters")
    wait_css(driver, "#dead-letters-table")
    driver.get(f"{flower.url}/dead-letters")  # without the credentials in the address
    wait_css(driver, "#dead-letters-table")


def make_letters(tools: Tools, *letters: tuple[ToolEffect, str]) -> list[DeadLetter]:
    """Real dead letters, as the browser test of tests/test_flower.py makes them: the tools
    fail with an AUTH error in a real worker, which dead-letters them."""
    with running_worker(tools.app):
        return [tools.dead_letter(effect, key) for effect, key in letters]


def untouched(app: Celery, *letters: Any) -> None:
    """Every letter is still stored, and no replay or purge of it was even attempted."""
    for letter in letters:
        assert DeadLetters(app).get(letter.task_id) is not None, letter.task_id
        acted = [event for event in _events(app, letter.run_id)
                 if event.get("via", "").startswith("flower")]
        assert acted == [], acted


# -- a forging page in a real browser ----------------------------------------------------


@pytest.mark.parametrize("auth", ["basic-auth", "no-auth"])
def test_a_page_from_another_origin_cannot_replay_or_purge(
    auth: str, tools: Tools, start_flower: Callable[..., FlowerProcess], browser: Any,
    attacker: Attacker,
) -> None:
    app = tools.app
    idem, write = make_letters(tools, (ToolEffect.IDEMPOTENT_WRITE, "xsrf-idem"),
                               (ToolEffect.NON_IDEMPOTENT_WRITE, "xsrf-write"))
    if auth == "basic-auth":
        flower = start_flower(f"--basic-auth={USER}")
        cache_credentials(browser, flower)
        # The browser does send the cached credentials with a request another site starts
        # (a cross-site GET lists the letters): what follows is refused as forgery, not for
        # want of credentials.
        shown = land(browser, flower, attacker.serve(
            form_page(f"{flower.url}/dead-letters", {"limit": "10"}, method="get")))
        assert idem.task_id in shown and write.task_id in shown, shown
    else:
        flower = start_flower(FLOWER_UNAUTHENTICATED_API="true")

    page = f"{flower.url}/dead-letters"
    api = f"{flower.url}/api/dead-letters"
    forged = {"reason": "forged", "confirm": "on", "force": "true"}
    forged_json = {"force": True, "reason": "forged", "confirm": "on"}
    attacks: list[tuple[str, str, dict[str, str], str]] = []
    for letter in (idem, write):
        for action in ("purge", "replay"):
            for target in (f"{page}/{letter.task_id}/{action}",
                           f"{api}/{letter.task_id}/{action}"):
                attacks += [
                    ("form-encoded", target, forged, ""),
                    ("text/plain JSON", target, json_lookalike(forged_json), "text/plain"),
                ]
    attacks.append(("multipart", f"{page}/{write.task_id}/purge", forged,
                    "multipart/form-data"))
    attacks.append(("multipart", f"{api}/{write.task_id}/replay", forged,
                    "multipart/form-data"))

    for kind, target, fields, enctype in attacks:
        text = land(browser, flower, attacker.serve(form_page(target, fields, enctype=enctype)))
        assert any(refusal in text for refusal in REFUSALS), (kind, target, text)
        untouched(app, idem, write)

    # Double-submit tossing: a page on the same host (another port) can set a cookie that
    # Flower receives (cookies ignore ports), so it plants an _xsrf cookie and sends the same
    # token. The token then matches; the origin check still refuses it.
    token = uuid.uuid4().hex
    tossed = form_page(f"{page}/{write.task_id}/purge", {"_xsrf": token, "reason": "forged"},
                       cookie=f"_xsrf={token}; path=/")
    text = land(browser, flower, attacker.serve(tossed))
    assert any(refusal in text for refusal in REFUSALS), text
    untouched(app, idem, write)

    # A script's JSON POST: Flower answers CORS preflights with "*" when its API is open
    # without authentication, so the browser sends it; it is refused all the same.
    browser.get(attacker.serve(fetch_page(f"{api}/{idem.task_id}/purge",
                                          json.dumps({"reason": "forged"}))))
    result = wait_for(lambda: browser.execute_script("return window.forged || null"),
                      what="the forged fetch")
    if auth == "no-auth":
        assert result == "status 403", result  # sent (CORS allowed it), and refused
    else:
        assert result == "status 403" or str(result).startswith("blocked"), result
    untouched(app, idem, write)


# -- the page's own forms -----------------------------------------------------------------


def test_the_pages_own_forms_still_work_in_a_real_browser(
    tools: Tools, start_flower: Callable[..., FlowerProcess], browser: Any
) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    app = tools.app
    idem, write = make_letters(tools, (ToolEffect.IDEMPOTENT_WRITE, "form-idem"),
                               (ToolEffect.NON_IDEMPOTENT_WRITE, "form-write"))
    flower = start_flower(f"--basic-auth={USER}")
    cache_credentials(browser, flower)

    # Replay of a NON_IDEMPOTENT_WRITE without the confirmation: the token is accepted, and
    # the replay rules answer (refused, nothing published).
    browser.get(f"{flower.url}/dead-letters/{write.task_id}")
    wait_css(browser, "#replay-form input[name='_xsrf']")
    base.click(browser, "#replay-button")
    wait_for(lambda: outcome(browser) == "refused", what="the refused replay")
    assert DeadLetters(app).get(write.task_id) is not None

    # Purge from the letter's page (it asks for a confirmation first).
    browser.get(f"{flower.url}/dead-letters/{idem.task_id}")
    wait_css(browser, "#purge-form input[name='_xsrf']")
    browser.find_element(By.CSS_SELECTOR, "#purge-reason").send_keys("obsolete")
    base.click(browser, "#purge-button")

    def accept() -> bool:
        try:
            browser.switch_to.alert.accept()
            return True
        except NoAlertPresentException:
            return False

    wait_for(accept, what="the purge confirmation")
    wait_for(lambda: outcome(browser) == "done", what="the purge")
    assert DeadLetters(app).get(idem.task_id) is None
    purged = [event for event in _events(app, idem.run_id) if event.get("via") == "flower"]
    assert purged and purged[-1]["actor"].startswith("ops (flower ")


# -- the rules over plain HTTP ---------------------------------------------------------------


def _post(url: str, data: bytes = b"", *, content_type: str | None = None,
          user: str | None = USER, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST exactly these headers (urllib would add a form Content-Type of its own)."""
    parts = urllib.parse.urlsplit(url)
    sent = dict(headers or {})
    if content_type is not None:
        sent["Content-Type"] = content_type
    if user:
        sent["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
    connection = http.client.HTTPConnection(parts.netloc, timeout=20)
    try:
        connection.request("POST", parts.path, body=data, headers=sent)
        response = connection.getresponse()
        return int(response.status), response.read().decode(errors="replace")
    finally:
        connection.close()


def _form(fields: dict[str, str]) -> bytes:
    return urllib.parse.urlencode(fields).encode()


FORM = "application/x-www-form-urlencoded"


@pytest.mark.parametrize("auth", ["basic-auth", "no-auth"])
def test_posts_without_a_token_or_a_json_body_are_refused(
    auth: str, tools: Tools, start_flower: Callable[..., FlowerProcess]
) -> None:
    app = tools.app
    idem, write = make_letters(tools, (ToolEffect.IDEMPOTENT_WRITE, "http-idem"),
                               (ToolEffect.NON_IDEMPOTENT_WRITE, "http-write"))
    if auth == "basic-auth":
        flower = start_flower(f"--basic-auth={USER}")
        # Flower 2.2 refuses a mismatched Origin itself under --basic-auth, in its words.
        cross_origin = ("Cross-origin request refused", "Cross-origin request forbidden")
    else:
        # Flower checks nothing without authentication: these are this package's refusals.
        flower = start_flower(FLOWER_UNAUTHENTICATED_API="true")
        cross_origin = ("Cross-origin request refused",)
    page = f"{flower.url}/dead-letters"
    api = f"{flower.url}/api/dead-letters"
    forged = {"reason": "forged", "confirm": "on", "force": "true"}

    # The page: no _xsrf token, a token without its cookie, a token of another cookie.
    for letter in (idem, write):
        for action in ("purge", "replay"):
            url = f"{page}/{letter.task_id}/{action}"
            status, body = _post(url, _form(forged), content_type=FORM)
            assert status == 403, (url, status, body)
            assert "'_xsrf' argument missing" in html.unescape(body), body
            status, body = _post(url, _form({**forged, "_xsrf": uuid.uuid4().hex}),
                                 content_type=FORM)
            assert status == 403, (url, status, body)
            token = uuid.uuid4().hex
            status, body = _post(url, _form({**forged, "_xsrf": token}), content_type=FORM,
                                 headers={"Cookie": f"_xsrf={uuid.uuid4().hex}"})
            assert status == 403 and "XSRF cookie does not match" in body, (url, status)
            # The right token, but from a browser on another origin.
            status, body = _post(url, _form({**forged, "_xsrf": token}), content_type=FORM,
                                 headers={"Cookie": f"_xsrf={token}",
                                          "Origin": "http://127.0.0.1:1"})
            assert status == 403 and any(text in body for text in cross_origin), (url, body)
    if auth == "basic-auth":
        assert _post(f"{page}/{idem.task_id}/purge", _form(forged), content_type=FORM,
                     user=None)[0] == 401
    untouched(app, idem, write)

    # The API: only a JSON object sent as application/json.
    lookalike = json.dumps({"force": True, "reason": "forged"}).encode()
    for letter in (idem, write):
        for action in ("purge", "replay"):
            url = f"{api}/{letter.task_id}/{action}"
            for data, content_type, expected in [
                (_form(forged), FORM, 415),
                (lookalike, "text/plain", 415),
                (lookalike, "text/plain; charset=utf-8", 415),
                (b'--x\r\nContent-Disposition: form-data; name="reason"\r\n\r\nforged\r\n--x--',
                 "multipart/form-data; boundary=x", 415),
                (lookalike, None, 415),
                (b"", None, 415),
                (b"[]", "application/json", 400),
                (b'"purge"', "application/json", 400),
                (b"{not json", "application/json", 400),
                (b"\xff\xfe{}", "application/json", 400),
            ]:
                status, body = _post(url, data, content_type=content_type)
                assert status == expected, (url, content_type, data, status, body)
            # JSON, but from a page on another origin.
            status, body = _post(url, lookalike, content_type="application/json",
                                 headers={"Origin": "http://127.0.0.1:1"})
            assert status == 403 and any(text in body for text in cross_origin), (url, body)
            status, body = _post(url, lookalike, content_type="application/json",
                                 headers={"Sec-Fetch-Site": "same-site"})
            assert status == 403, (url, status, body)
    if auth == "basic-auth":
        assert _post(f"{api}/{idem.task_id}/purge", b"{}", content_type="application/json",
                     user=None)[0] == 401
    untouched(app, idem, write)


def test_the_pages_token_and_json_api_calls_still_work(
    tools: Tools, start_flower: Callable[..., FlowerProcess]
) -> None:
    app = tools.app
    first, second, third, write = make_letters(
        tools, (ToolEffect.IDEMPOTENT_WRITE, "ok-first"),
        (ToolEffect.IDEMPOTENT_WRITE, "ok-second"), (ToolEffect.READ_ONLY, "ok-third"),
        (ToolEffect.NON_IDEMPOTENT_WRITE, "ok-write"))
    flower = start_flower(f"--basic-auth={USER}")
    auth = {"Authorization": "Basic " + base64.b64encode(USER.encode()).decode()}

    # A client that reads the page's _xsrf cookie and field, and sends them back.
    request = urllib.request.Request(f"{flower.url}/dead-letters/{first.task_id}", headers=auth)
    with urllib.request.urlopen(request, timeout=20) as response:
        cookie = response.headers["Set-Cookie"].split(";", 1)[0]
        page = response.read().decode()
    assert cookie.startswith("_xsrf=")
    fields = re.findall(r'name="_xsrf" value="([^"]+)"', page)
    assert len(fields) == 2  # one per form (replay and purge)
    status, body = _post(f"{flower.url}/dead-letters/{first.task_id}/purge",
                         _form({"_xsrf": html.unescape(fields[1]), "reason": "done"}),
                         content_type=FORM,
                         headers={"Cookie": cookie, "Sec-Fetch-Site": "same-origin",
                                  "Origin": flower.url})
    assert status == 200 and 'data-outcome="done"' in body, (status, body)
    assert DeadLetters(app).get(first.task_id) is None

    # JSON API calls: a body, an empty body (the defaults), and a charset parameter.
    api = f"{flower.url}/api/dead-letters"
    status, body = _post(f"{api}/{second.task_id}/purge", b'{"reason": "obsolete"}',
                         content_type="application/json")
    assert status == 200 and json.loads(body)["outcome"] == "done", body
    status, body = _post(f"{api}/{third.task_id}/purge", b"",
                         content_type="application/json; charset=utf-8")
    assert status == 200 and json.loads(body)["outcome"] == "done", body
    status, body = _post(f"{api}/{write.task_id}/replay", b"", content_type="application/json")
    assert status == 409 and json.loads(body)["outcome"] == "refused", body
    status, body = _post(f"{api}/{write.task_id}/purge", b"{}",
                         content_type="Application/JSON",
                         headers={"Sec-Fetch-Site": "same-origin", "Origin": flower.url})
    assert status == 200 and json.loads(body)["outcome"] == "done", body
    for letter in (second, third, write):
        assert DeadLetters(app).get(letter.task_id) is None
    purged = [event for event in _events(app, second.run_id) if event.get("via") == "flower-api"]
    assert purged and purged[-1]["actor"].startswith("ops (flower ")
