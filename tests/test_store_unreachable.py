"""Every operator command and Flower page of the package, with its Redis down.

Real processes only: a private ``redis-server`` of the test's (broker, result
backend, store and dead-letter store), a real worker that dead-letters a call
and parks one for approval, the CLI (click's CliRunner, as tests/test_cli.py
runs it, and real ``celery`` / ``celery-tooleffect`` subprocesses) and a real
Flower. Then the server is stopped (or refuses every command but PING), and
each command must end with exit code 1 and one line on stderr that names the
store by its URL (no password) and the error; each API request must answer
503 with ``{"error": ...}`` and each page an error page. Never a traceback.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
from celery import Celery
from click.testing import Result

from celery_tooleffect import Approvals, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.admin.cli import tooleffect
from tests.conftest import (
    TESTS,
    RedisServer,
    free_port,
    redis_server,
    running_worker,
    wait_for,
)
from tests.test_cli import invoke
from tests.test_flower import FlowerProcess, _answers, _request

pytestmark = pytest.mark.timeout(180)

#: Every command but ``flower`` (which needs no store to start), as run with the
#: store down: ``{letter}``, ``{approval}`` and ``{run}`` name real records.
COMMANDS = [
    ["dlq", "list"], ["dlq", "list", "--json"],
    ["dlq", "show", "{letter}"], ["dlq", "show", "{letter}", "--json"],
    ["dlq", "replay", "{letter}"], ["dlq", "replay", "{letter}", "--json"],
    ["dlq", "replay", "--all"],
    ["dlq", "purge", "{letter}", "--yes"], ["dlq", "purge", "--all", "--older-than", "0s"],
    ["dlq", "stats"], ["dlq", "stats", "--json"],
    ["dlq", "reconcile", "{letter}"], ["dlq", "reconcile", "--all", "--json"],
    ["approvals", "list"], ["approvals", "list", "--json"],
    ["approvals", "show", "{approval}"], ["approvals", "show", "{approval}", "--json"],
    ["approvals", "approve", "{approval}"], ["approvals", "approve", "{approval}", "--json"],
    ["approvals", "reject", "{approval}", "--reason", "no"],
    ["approvals", "stats"], ["approvals", "stats", "--json"],
    ["audit", "show", "{run}"], ["audit", "show", "{run}", "--json"],
    ["audit", "verify", "{run}"], ["audit", "verify", "--all", "--json"],
    ["audit", "head", "{run}"], ["audit", "head", "{run}", "--json"],
    ["audit", "tail"], ["audit", "tail", "--json"],
    ["runs", "show", "{run}"], ["runs", "show", "{run}", "--json"],
    ["tools"], ["tools", "--json"],
    ["store"], ["store", "--json"],
]


@dataclass
class Records:
    """An app on a private Redis that holds a dead letter and a parked call."""

    app: Celery
    server: RedisServer
    prefix: str
    letter: str
    approval: str
    run: str

    def args(self, command: list[str]) -> list[str]:
        return [part.format(letter=self.letter, approval=self.approval, run=self.run)
                for part in command]


@pytest.fixture
def records(make_app: Callable[..., Celery], prefix: str) -> Iterator[Records]:
    """A real worker dead-letters ``tools.read`` and parks ``tools.approved_write``."""
    with redis_server() as server:
        app = make_app(broker_url=server.url, result_backend=server.url)

        def fails(key: str, hold: float = 0.0) -> str:
            raise ValueError(f"provider rejected {key}")

        def approved(key: str, hold: float = 0.0) -> str:
            return key

        app.task(base=ToolTask, name="tools.read", shared=False)(fails)
        app.task(base=ToolTask, name="tools.approved_write", shared=False,
                 effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)(approved)
        run = f"run-{uuid.uuid4().hex[:8]}"
        with running_worker(app):
            # Only the ids are kept: a result left pending unsubscribes when
            # collected, which would fail once the server is stopped.
            letter = str(app.send_task("tools.read", args=["k"],
                                       headers={"tooleffect_run_id": run}).id)
            wait_for(lambda: DeadLetters(app).get(letter), what="the dead letter")
            parked = str(app.send_task("tools.approved_write", args=["k"]).id)
            wait_for(lambda: Approvals(app).get(parked), what="the parked call")
        yield Records(app, server, prefix, letter, parked, run)


def leaf_commands(group: click.Group, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found |= leaf_commands(command, (*path, name))
        else:
            found.add((*path, name))
    return found


def one_line(result: Result, starts: str) -> str:
    """The single stderr line of a command that exited 1 without a traceback."""
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts), result.stderr
    return lines[0]


# -- the CLI ---------------------------------------------------------------------------


def test_every_command_says_in_one_line_that_the_store_is_down(records: Records) -> None:
    tested = {tuple(word for word in command[:2] if not word.startswith("-"))
              for command in COMMANDS}
    # flower and mcp are servers: a store that is down is answered per request
    # there (tests/test_flower.py, tests/agents/test_mcp.py).
    assert tested == leaf_commands(tooleffect) - {("flower",), ("mcp",)}, \
        "a command is not tested"
    assert invoke(records.app, "dlq", "show", records.letter).exit_code == 0

    records.server.stop()
    down = f"the store {records.server.url} is unavailable: Error 111 connecting to"
    for command in COMMANDS:
        result = invoke(records.app, *records.args(command))
        one_line(result, down)
        assert result.stdout == "", (command, result.stdout)


def test_the_commands_of_celery_and_the_console_script_say_so_too(records: Records) -> None:
    env = dict(os.environ, TE_PREFIX=records.prefix, TE_BROKER=records.server.url,
               TE_STORE="", PYTHONPATH=str(TESTS.parent))
    records.server.stop()
    for command in (
        [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect",
         "dlq", "replay", records.letter],
        [sys.executable, "-m", "celery_tooleffect.admin.cli", "-A", "tests.apps.tool_app",
         "dlq", "reconcile", records.letter],
    ):
        done = subprocess.run(command, cwd=TESTS.parent, env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr + done.stdout
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"the store {records.server.url} is unavailable: ")


def test_the_line_names_which_store_is_down(make_app: Callable[..., Celery]) -> None:
    with redis_server() as up, redis_server() as down:
        down.stop()
        # Dead letters on the broker's Redis (up), journal, audit and approvals down.
        store_down = make_app(broker_url=up.url, result_backend=up.url,
                              tooleffect_redis_url=down.url)
        assert invoke(store_down, "dlq", "list").exit_code == 0
        for command in (["dlq", "replay", "t1"], ["dlq", "purge", "t1", "--yes"],
                        ["approvals", "list"], ["audit", "tail"]):
            one_line(invoke(store_down, *command), f"the store {down.url} is unavailable: ")

        letters_down = make_app(broker_url=down.url, result_backend=up.url,
                                tooleffect_redis_url=up.url)
        assert invoke(letters_down, "approvals", "stats").exit_code == 0
        assert invoke(letters_down, "audit", "tail").exit_code == 0
        for command in (["dlq", "list"], ["dlq", "show", "t1"], ["dlq", "stats"],
                        ["dlq", "reconcile", "t1"]):
            one_line(invoke(letters_down, *command),
                     f"the dead-letter store {down.url} is unavailable: ")


def test_a_store_that_refuses_is_named_without_its_password(
    make_app: Callable[..., Celery],
) -> None:
    with redis_server() as server:
        # A user that may PING and nothing else: every other command is refused.
        server.client().acl_setuser("ops", enabled=True, passwords=["+s3cret"],
                                    commands=["+ping"], keys=["*"])
        url = f"redis://ops:s3cret@127.0.0.1:{server.port}/0"
        app = make_app(broker_url=url, result_backend=url)
        shown = f"the store redis://ops:***@127.0.0.1:{server.port}/0 failed: "
        for command in (["dlq", "list"], ["dlq", "stats"], ["approvals", "list"],
                        ["audit", "show", "r1"], ["audit", "tail"]):
            line = one_line(invoke(app, *command), shown)
            assert "no permissions" in line and "s3cret" not in line
        # A task id's refusal is its one result line.
        result = invoke(app, "dlq", "replay", "t1")
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert len(result.stderr.splitlines()) == 1 and "s3cret" not in result.output


def test_invalid_settings_are_one_line(make_app: Callable[..., Celery], tmp_path: Path) -> None:
    app = make_app(tooleffect_privacy="everything")
    for command in COMMANDS:
        line = one_line(invoke(app, *[part.format(letter="t1", approval="t1", run="r1")
                                      for part in command]),
                        "invalid celery-tooleffect settings: ")
        assert "tooleffect_privacy" in line

    # Flower too (a real process: the app is loaded from a module).
    (tmp_path / "bad_app.py").write_text(
        "from celery import Celery\n"
        "app = Celery('bad', broker='redis://127.0.0.1:1/0')\n"
        "app.conf.tooleffect_privacy = 'everything'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent))
    done = subprocess.run(
        [sys.executable, "-m", "celery_tooleffect.admin.cli", "--workdir", str(tmp_path),
         "-A", "bad_app", "flower", f"--port={free_port()}", "--address=127.0.0.1"],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith(
        "invalid celery-tooleffect settings: tooleffect_privacy"), done.stderr


# -- Flower ------------------------------------------------------------------------------


@pytest.fixture
def flower(records: Records, tmp_path: Path) -> Iterator[FlowerProcess]:
    """``celery -A tests.apps.tool_app tooleffect flower`` on the records' Redis."""
    port = free_port()
    log = tmp_path / "flower.log"
    env = dict(os.environ, TE_PREFIX=records.prefix, TE_BROKER=records.server.url,
               TE_STORE="", PYTHONPATH=str(TESTS.parent), FLOWER_UNAUTHENTICATED_API="true")
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect", "flower",
         f"--port={port}", "--address=127.0.0.1"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=str(TESTS.parent),
        start_new_session=True,
    )
    running = FlowerProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_for(lambda: _answers(running) or process.poll() is not None, timeout=40,
                 what="Flower to answer")
        assert process.poll() is None, running.output()
        yield running
    finally:
        process.terminate()
        try:
            process.wait(3)  # with its broker down, Flower takes long to stop
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _form(url: str, fields: dict[str, str]) -> tuple[int, str]:
    """POST a page's form, with a (version 1) ``_xsrf`` token and its cookie."""
    import urllib.error
    import urllib.parse
    import urllib.request

    token = uuid.uuid4().hex
    data = urllib.parse.urlencode({**fields, "_xsrf": token}).encode()
    request = urllib.request.Request(url, data=data, method="POST")
    request.add_header("Cookie", f"_xsrf={token}")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def test_flower_answers_503_with_one_line_when_the_store_is_down(
    records: Records, flower: FlowerProcess,
) -> None:
    url, letter, approval = flower.url, records.letter, records.approval
    assert _request(f"{url}/api/dead-letters/{letter}")[0] == 200
    assert _request(f"{url}/api/approvals/{approval}")[0] == 200

    records.server.stop()
    down = f"the store {records.server.url} is unavailable: Error 111 connecting to"
    for path in ("dead-letters", "dead-letters/stats", f"dead-letters/{letter}",
                 "approvals", "approvals/stats", f"approvals/{approval}"):
        status, body = _request(f"{url}/api/{path}")
        assert status == 503, (path, body)
        assert json.loads(body)["error"].startswith(down), (path, body)
    actions: list[tuple[str, dict[str, Any]]] = [
        (f"dead-letters/{letter}/replay", {"force": True, "reason": "why"}),
        (f"dead-letters/{letter}/purge", {}), (f"dead-letters/{letter}/reconcile", {}),
        (f"approvals/{approval}/approve", {}), (f"approvals/{approval}/reject", {"reason": "no"}),
    ]
    for path, payload in actions:
        status, answer = _request(f"{url}/api/{path}", method="POST", body=payload)
        assert status == 503, (path, answer)
        error = json.loads(answer)
        assert list(error) == ["error"] and error["error"].startswith(down), (path, answer)

    pages = [_request(f"{url}/{path}") for path in
             ("dead-letters", f"dead-letters/{letter}", "approvals", f"approvals/{approval}")]
    pages += [_form(f"{url}/dead-letters/{letter}/replay", {"reason": "why", "confirm": "1"}),
              _form(f"{url}/dead-letters/{letter}/purge", {}),
              _form(f"{url}/approvals/{approval}/approve", {"reason": ""})]
    for status, page in pages:
        assert status == 503, page
        assert down in html.unescape(page) and "Traceback" not in page
        assert "<html" in page.lower()

    # /metrics is served all the same, without the store's gauges.
    status, metrics = _request(f"{url}/metrics")
    assert status == 200 and "tooleffect_dead_letters{" not in metrics
    assert "Traceback" not in flower.output() and "Uncaught exception" not in flower.output()
