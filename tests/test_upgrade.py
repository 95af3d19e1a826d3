"""Rolling upgrades that change a tool's effect: the strictest effect wins.

Real ``celery worker`` processes of two releases of one app
(tests/apps/upgrade_app.py): release 1 declares ``t.changing`` and
``t.retrying`` READ_ONLY, release 2 NON_IDEMPOTENT_WRITE, with the same body
(release 1 had the effect wrong). Each run of a body appends a line to a file,
so a test counts how many times it really ran, and on which release.

- A release-2 worker SIGKILLed mid-body, a release-1 worker takes the
  redelivery: the body ran once, the call is a dead letter
  ``interrupted_write`` (the journal recorded a non-idempotent write); the
  same with both releases live when it dies (release 1 may find the dead
  owner's journal lease still running and defer the call first).
- A release-1 worker runs an attempt the journal recorded as a
  non-idempotent write (release 2 asked for a retry), and its pool child is
  SIGKILLed: the worker's main process ends it as that write, a dead letter
  ``interrupted_write``, though its code says READ_ONLY.
- Workers publish the effects they declare; two live releases that disagree
  are warned about by each worker and listed by ``celery -A app tooleffect
  tools``; a dead worker's entry lapses, a stopped worker's is withdrawn.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_tooleffect import AuditLog, DeadLetters
from celery_tooleffect.admin.cli import tooleffect
from celery_tooleffect.settings import settings_for
from celery_tooleffect.store.declarations import EffectDeclarations, by_tool
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from tests.conftest import REDIS_URL, TESTS, WorkerProcess, app_config, on_broker, wait_for

pytestmark = pytest.mark.timeout(180)

APP = "tests.apps.upgrade_app"
#: The visibility timeout on Redis: a killed worker's message comes back soon.
VT = 3.0


def runs_of(path: Path) -> list[tuple[str, int]]:
    """Each run of a body so far: (release, pid of the process that ran it)."""
    if not path.exists():
        return []
    return [(release, int(pid)) for release, pid in
            (line.split() for line in path.read_text().splitlines() if line.strip())]


def producer(make_app: Callable[..., Celery], prefix: str, broker_url: str) -> Celery:
    return make_app(**on_broker(prefix, broker_url, visibility_timeout=VT))


def failed(app: Celery, task_id: str) -> bool:
    return bool(app.AsyncResult(task_id).state == "FAILURE")


def test_a_write_killed_on_release_2_is_a_dead_letter_on_release_1(
    make_app: Callable[..., Celery], app_workers: Callable[..., WorkerProcess],
    prefix: str, broker_url: str, tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    env = {"TE_RUNS": str(runs), "TE_VT": str(VT)}
    app = producer(make_app, prefix, broker_url)
    second = app_workers(APP, concurrency=1, TE_RELEASE="2", **env)
    result = app.send_task("t.changing", args=["k"])
    wait_for(lambda: runs_of(runs), what="the body to start on release 2")
    second.kill()  # main process and pool child: nothing settles the attempt
    journal = runtime_for(app).journal
    ref = JournalRef(result.id, result.id)
    entry = journal.read(ref)
    assert (entry["state"], entry["effect"]) == ("running", "non_idempotent_write")

    # Redis gives the message back once the visibility timeout lapsed,
    # RabbitMQ as soon as the killed worker's connection closed, each marked
    # redelivered. The release-1 worker starts once the dead owner's journal
    # lease lapsed, so that its delivery is settled at once (not deferred to
    # a live owner first).
    wait_for(lambda: float(journal.read(ref)["lease_end"]) < time.time(), timeout=30,
             what="the killed owner's journal lease to lapse")
    first = app_workers(APP, concurrency=1, TE_RELEASE="1", **env)
    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=90,
                      what="the dead letter on release 1")
    wait_for(lambda: failed(app, result.id), what="FAILURE on the result backend")

    assert letter.reason == "interrupted_write", first.output()[-3000:]
    assert letter.effect == "non_idempotent_write"
    assert [release for release, _ in runs_of(runs)] == ["2"], first.output()[-3000:]
    events = AuditLog(app).events(result.id)
    phases = [event["phase"] for event in events]
    assert phases.count("intent") == 1, phases
    assert "interrupted" in phases
    ended = [event for event in events if event["phase"] == "dead_lettered"]
    assert [(event["status"], event["effect"]) for event in ended] == [
        ("interrupted_write", "non_idempotent_write")]
    # Dead-lettered by the release-1 worker (its main process holds the message).
    assert ended[0]["worker"].endswith(f":{first.process.pid}"), ended


def test_a_recorded_write_interrupted_on_release_1_is_a_dead_letter(
    make_app: Callable[..., Celery], app_workers: Callable[..., WorkerProcess],
    prefix: str, broker_url: str, tmp_path: Path,
) -> None:
    """Release 1's pool process runs a call the journal recorded as a
    non-idempotent write under that effect; its child is killed mid-body: the
    worker's main process, whose code says READ_ONLY, ends it as that write."""
    runs = tmp_path / "runs"
    env = {"TE_RUNS": str(runs), "TE_VT": str(VT), "TE_RETRY_COUNTDOWN": "6"}
    app = producer(make_app, prefix, broker_url)
    second = app_workers(APP, concurrency=1, TE_RELEASE="2", **env)
    result = app.send_task("t.retrying", args=["k"])
    # Release 2's first attempt asks for a retry; its worker takes the retry
    # (the same task id) and holds it for its countdown: killed meanwhile,
    # the retry comes back to the broker, marked redelivered.
    wait_for(lambda: second.output().count(f"t.retrying[{result.id}] received") >= 2,
             what="release 2 to hold the retry")
    second.kill()
    journal = runtime_for(app).journal
    entry = journal.read(JournalRef(result.id, result.id))
    assert (entry["state"], entry["effect"]) == ("retry_scheduled", "non_idempotent_write")

    first = app_workers(APP, concurrency=1, TE_RELEASE="1", **env)
    wait_for(lambda: len(runs_of(runs)) == 2, timeout=60,
             what="the retry's body to start on release 1")
    release, child = runs_of(runs)[1]
    assert release == "1" and child != first.process.pid
    os.kill(child, signal.SIGKILL)

    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                      what="the dead letter on release 1")
    wait_for(lambda: failed(app, result.id), what="FAILURE on the result backend")
    # Release 2's attempt (which asked for the retry), then release 1's: the
    # interrupted one is not run again.
    assert [release for release, _ in runs_of(runs)] == ["2", "1"], first.output()[-3000:]
    assert letter.reason == "interrupted_write", first.output()[-3000:]
    assert letter.effect == "non_idempotent_write"
    # Decided by release 1's main process when it lost the child (not by a
    # later delivery that found the journal interrupted).
    assert letter.exception_type == "WorkerLostError"
    events = AuditLog(app).events(result.id)
    phases = [event["phase"] for event in events]
    assert phases.count("intent") == 2, phases
    interrupted = [event for event in events if event["phase"] == "interrupted"]
    assert [(event["status"], event["effect"]) for event in interrupted] == [
        ("worker_lost", "non_idempotent_write")]
    assert interrupted[0]["worker"].endswith(f":{first.process.pid}")


# -- declared effects, the warning and the tools command -------------------------------


def invoke(app: Celery, *args: str) -> Result:
    """``celery -A <app> tooleffect <args>`` in this process."""
    return CliRunner().invoke(
        tooleffect, list(args), obj=CLIContext(app=app, no_color=True, workdir=None),
        env={"COLUMNS": "160"},
    )


def tools_json(app: Celery) -> tuple[int, Any]:
    result = invoke(app, "tools", "--json")
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("broker_url", [REDIS_URL], ids=["redis"])
def test_two_live_releases_that_disagree_are_warned_about_and_listed(
    make_app: Callable[..., Celery], app_workers: Callable[..., WorkerProcess],
    prefix: str, broker_url: str, tmp_path: Path,
) -> None:
    app = producer(make_app, prefix, broker_url)
    # Refreshed every half second: a killed worker's entry lapses in 1.5 s.
    env = {"TE_RUNS": str(tmp_path / "runs"), "TE_DECLARE_INTERVAL": "0.5"}
    first = app_workers(APP, concurrency=1, TE_RELEASE="1", **env)
    second = app_workers(APP, concurrency=1, TE_RELEASE="2", **env)

    # The second sees the first at start; the first sees the second at its
    # next refresh. Each names the tool, both effects, both workers and releases.
    for worker, other, mine, theirs in ((second, first, "2", "1"), (first, second, "1", "2")):
        effects = {"1": "read_only", "2": "non_idempotent_write"}
        expected = (f"tool t.changing is declared {effects[mine]} by this worker "
                    f"{worker.name} (release {mine}) and {effects[theirs]} by the live "
                    f"worker {other.name} (release {theirs})")
        wait_for(lambda worker=worker, expected=expected: expected in worker.output(),
                 what=f"the warning of {worker.name}")
        warnings = [line for line in worker.output().splitlines() if "t.changing is" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0], warnings  # once, not per tick

    code, listing = tools_json(app)
    assert code == 1  # a conflict is listed
    assert listing["conflicts"] == ["t.changing", "t.retrying"]
    changing = next(tool for tool in listing["tools"] if tool["name"] == "t.changing")
    assert changing["conflict"] is True
    assert changing["effects"] == ["non_idempotent_write", "read_only"]  # strictest first
    assert changing["strictest"] == "non_idempotent_write"
    assert sorted((d["worker"], d["release"], d["effect"]) for d in changing["declared_by"]) \
        == sorted([(first.name, "1", "read_only"), (second.name, "2", "non_idempotent_write")])
    assert {w["worker"]: w["release"] for w in listing["workers"]} == {
        first.name: "1", second.name: "2"}

    table = invoke(app, "tools")
    assert table.exit_code == 1
    rows = [line for line in table.stdout.splitlines() if line.startswith("t.changing")]
    assert len(rows) == 2 and all("CONFLICT" in row for row in rows), table.stdout
    assert [row.split()[1:4] for row in rows] == [["non_idempotent_write", "2", "1"],
                                                  ["read_only", "1", "1"]], table.stdout
    assert second.name in rows[0] and first.name in rows[1]
    assert ("CONFLICT t.changing: non_idempotent_write by 1 worker(s) of release 2; "
            "read_only by 1 worker(s) of release 1.") in " ".join(table.stdout.split())
    assert "2 tool(s), 2 live worker(s), 2 conflict(s)" in table.stdout

    # The real command line says the same.
    command = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "tooleffect", "tools", "--json"],
        capture_output=True, text=True, timeout=60, cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": str(TESTS.parent), "TE_PREFIX": prefix,
             "TE_BROKER": broker_url, "TE_RELEASE": "1"},
    )
    assert command.returncode == 1, command.stderr
    assert json.loads(command.stdout)["conflicts"] == ["t.changing", "t.retrying"]

    # A worker that died stops counting once its entry lapsed...
    first.kill()
    wait_for(lambda: tools_json(app)[0] == 0, timeout=20,
             what="the killed worker's entry to lapse")
    code, listing = tools_json(app)
    assert [w["worker"] for w in listing["workers"]] == [second.name]
    assert listing["conflicts"] == []
    # ... and one that stops withdraws its own at once.
    second.stop()
    assert tools_json(app) == (0, {"tools": [], "workers": [], "conflicts": []})
    assert "No live worker declares any tool" in invoke(app, "tools").stdout


def test_declarations_lapse_and_are_pruned_by_the_next_writer(
    make_app: Callable[..., Celery], main_redis: redis.Redis,
) -> None:
    app = make_app()
    store = EffectDeclarations(settings_for(app))
    key = store.keys.declared_effects
    now = 1_000_000.0
    store.publish("w1@h", release="1", tools={"t.a": "read_only"}, ttl=10, pid=1, now=now)
    main_redis.hset(key, "junk@h", "not json")
    live = store.publish("w2@h", release="2", tools={"t.a": "non_idempotent_write",
                                                     "t.b": "idempotent_write"},
                         ttl=10, now=now + 5)
    assert [w.worker for w in live] == ["w1@h", "w2@h"]
    assert main_redis.hexists(key, "junk@h") is False  # not an entry: pruned
    assert 0 < main_redis.ttl(key) <= 20

    tools = by_tool(store.live(now=now + 5))
    assert [(t.name, t.conflict, t.strictest) for t in tools] == [
        ("t.a", True, "non_idempotent_write"), ("t.b", False, "idempotent_write")]

    # w1 was last written at `now`: lapsed at now + 10 for readers; the next
    # writer deletes it.
    assert [w.worker for w in store.live(now=now + 11)] == ["w2@h"]
    assert main_redis.hexists(key, "w1@h")  # readers never write
    store.publish("w2@h", release="2", tools={"t.a": "non_idempotent_write"}, ttl=10,
                  now=now + 11)
    assert not main_redis.hexists(key, "w1@h")
    store.withdraw("w2@h")
    assert store.live(now=now + 11) == []


def test_both_releases_live_a_write_killed_on_release_2_runs_once(
    make_app: Callable[..., Celery], app_workers: Callable[..., WorkerProcess],
    prefix: str, broker_url: str, tmp_path: Path,
) -> None:
    """A rolling upgrade as it happens: both releases consume the queue when the
    release-2 worker dies mid-body. Release 1 may take the redelivery while the
    dead owner's journal lease still runs (on RabbitMQ it always does): the
    call is deferred to that lease's end, and then ends as the write it is."""
    runs = tmp_path / "runs"
    env = {"TE_RUNS": str(runs), "TE_VT": str(VT)}
    app = producer(make_app, prefix, broker_url)
    second = app_workers(APP, concurrency=1, TE_RELEASE="2", **env)
    result = app.send_task("t.changing", args=["k"])
    wait_for(lambda: runs_of(runs), what="the body to start on release 2")
    first = app_workers(APP, concurrency=1, TE_RELEASE="1", **env)
    second.kill()

    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=90,
                      what="the dead letter on release 1")
    wait_for(lambda: failed(app, result.id), what="FAILURE on the result backend")
    assert [release for release, _ in runs_of(runs)] == ["2"], first.output()[-3000:]
    assert (letter.reason, letter.effect) == ("interrupted_write", "non_idempotent_write")
    phases = [event["phase"] for event in AuditLog(app).events(result.id)]
    assert phases.count("intent") == 1, phases


def test_the_release_defaults_to_the_apps_distribution_version(prefix: str) -> None:
    def release_of(main: str, **conf: Any) -> str:
        app = Celery(main, set_as_current=False)
        app.conf.update(app_config(prefix, **conf))
        return settings_for(app).release

    import celery_tooleffect

    # celery_tooleffect is installed: its distribution names its version.
    assert release_of("celery_tooleffect.demo") == celery_tooleffect.__version__
    assert release_of("__main__") == ""
    assert release_of("no_such_package.tasks") == ""
    assert release_of("celery_tooleffect.demo", tooleffect_release="2026.12.1") == "2026.12.1"


def test_an_in_process_worker_publishes_and_withdraws_its_declarations(
    make_app: Callable[..., Celery],
) -> None:
    from celery_tooleffect import ToolEffect, ToolTask
    from celery_tooleffect.worker.startup import declared_effects
    from tests.conftest import running_worker

    def body() -> None:
        return None

    app = make_app(tooleffect_release="7")
    app.task(base=ToolTask, name="t.read", shared=False)(body)
    app.task(base=ToolTask, name="t.write", shared=False,
             effect=ToolEffect.IDEMPOTENT_WRITE)(body)
    store = EffectDeclarations(settings_for(app))
    with running_worker(app) as worker:
        (entry,) = store.live()
        assert (entry.worker, entry.release) == (worker.hostname, "7")
        # Exactly what the app's registry declares: its two tools, and any
        # shared task (another test module's, in this process) registered on
        # every app.
        assert entry.tools == declared_effects(app)
        assert (entry.tools["t.read"], entry.tools["t.write"]) == (
            "read_only", "idempotent_write")
    assert store.live() == []


def test_a_read_asks_the_journal_only_on_a_delivery_that_may_not_be_its_first(
    make_app: Callable[..., Celery],
) -> None:
    """The messages a stricter release may have handled first (redelivered,
    retried, deferred, replayed) make a READ_ONLY worker read the journal; a
    first delivery does not. A deferral's copy is told apart by the header
    every republish from a request carries."""
    from celery.app.task import Context

    from celery_tooleffect import ToolTask
    from celery_tooleffect.store.envelope import REPLAY_HEADER
    from celery_tooleffect.worker.attempt import AGAIN_HEADER, delivered_again

    assert not delivered_again({}, {"redelivered": False}, 0)
    assert not delivered_again({"tooleffect_run_id": "r"}, None, 0)
    assert delivered_again({}, {"redelivered": True}, 0)
    assert delivered_again({}, None, 1)
    assert delivered_again({AGAIN_HEADER: "1"}, None, 0)
    assert delivered_again({REPLAY_HEADER: "x"}, None, 0)

    app = make_app()
    def republished() -> None:
        return None

    tool = app.task(base=ToolTask, name="t.republished", shared=False)(republished)
    request = Context(id="t-1", args=(), kwargs={}, headers={"tooleffect_run_id": "r"},
                      delivery_info={"exchange": "", "routing_key": "tools"})
    options = tool.signature_from_request(request, countdown=3).options
    assert options["headers"] == {"tooleffect_run_id": "r", AGAIN_HEADER: "1"}
