"""``approvals`` on the operator's command line, with real workers and the CLI
run as an operator runs it: a subprocess (``celery-tooleffect -A
tests.apps.tool_app approvals ...`` and ``celery -A tests.apps.tool_app
tooleffect approvals ...``) on the test's broker.

``tools.approved_write`` (tests/apps/tool_app.py) needs approval for every
call, ``tools.refund`` for refunds above 100 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_tooleffect import Approvals, ApprovalState, AuditLog
from celery_tooleffect.admin.cli import tooleffect
from tests.conftest import REDIS_URL, Counter, WorkerProcess, on_broker, wait_for

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 100


@pytest.fixture
def app(make_app: Callable[..., Celery], prefix: str, broker_url: str) -> Celery:
    return make_app(**on_broker(prefix, broker_url))


def operator(prefix: str, broker_url: str, *arguments: str, celery: bool = False,
             columns: int = WIDTH) -> subprocess.CompletedProcess[str]:
    """``celery-tooleffect -A tests.apps.tool_app approvals <arguments>`` (or, with
    ``celery``, ``celery -A tests.apps.tool_app tooleffect approvals ...``), its
    output ``columns`` wide."""
    env = dict(os.environ, TE_PREFIX=prefix, TE_BROKER=broker_url, TE_COUNTERS=REDIS_URL,
               TE_VT="60", TE_STORE="", COLUMNS=str(columns), TOOLEFFECT_ACTOR="ops-cli")
    command = ([sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect"]
               if celery else
               [sys.executable, "-m", "celery_tooleffect.admin.cli", "-A", "tests.apps.tool_app"])
    return subprocess.run([*command, "approvals", *arguments], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def as_json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.stdout, done.stderr
    return json.loads(done.stdout)


def park(app: Celery, name: str, *args: Any) -> str:
    """Send a call that needs approval; its task id once a worker parked it."""
    result = app.send_task(name, args=list(args), queue="tools")
    wait_for(lambda: Approvals(app).get(result.id), timeout=60, what=f"{name} to be parked")
    return str(result.id)


def decisions(app: Celery, run_id: str) -> list[tuple[str, str, str, str]]:
    return [(e["status"], e.get("actor", ""), e.get("reason", ""), e.get("via", ""))
            for e in AuditLog(app).events(run_id) if e["phase"] == "approval"]


# -- with a worker ----------------------------------------------------------------------


def test_list_show_and_stats_of_parked_calls(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    prefix: str, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key, refund_key = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    write_id = park(app, "tools.approved_write", key)
    refund_id = park(app, "tools.refund", refund_key, 250)

    listed = operator(prefix, broker_url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    report = as_json(listed)
    assert report["count"] == 2
    assert [a["task_id"] for a in report["approvals"]] == [write_id, refund_id]
    first = report["approvals"][0]
    assert set(first) == {"task_id", "run_id", "name", "queue", "effect", "state",
                          "requested_at", "arguments", "worker", "decided_by",
                          "decided_at", "reason", "approver", "user_decided_by",
                          "shown_digest"}
    assert (first["name"], first["queue"], first["effect"], first["state"]) == (
        "tools.approved_write", "tools", "non_idempotent_write", "pending")
    assert (first["approver"], first["user_decided_by"], first["shown_digest"]) == (
        "operator", "", "")
    # tooleffect_privacy is metadata: sizes, never the values.
    assert first["arguments"] == {"args_size": str(len(json.dumps([key]))),
                                  "kwargs_size": "2"}
    assert first["run_id"] == write_id and first["worker"]
    assert (first["decided_by"], first["decided_at"], first["reason"]) == ("", None, "")

    by_tool = as_json(operator(prefix, broker_url, "list", "--tool", "tools.refund",
                               "--json"))
    assert [a["task_id"] for a in by_tool["approvals"]] == [refund_id]
    paged = as_json(operator(prefix, broker_url, "list", "--limit", "1", "--offset", "1",
                             "--json"))
    assert [a["task_id"] for a in paged["approvals"]] == [refund_id]
    assert as_json(operator(prefix, broker_url, "list", "--state", "approved",
                            "--json")) == {"approvals": [], "count": 0}

    table = operator(prefix, broker_url, "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["TASK", "ID", "TOOL", "QUEUE"]
    assert write_id in table.stdout and refund_id in table.stdout
    assert "pending" in table.stdout and lines[-1] == "2 shown"
    assert all(len(line) <= WIDTH for line in lines)

    shown = operator(prefix, broker_url, "show", refund_id, "--json")
    assert shown.returncode == 0, shown.stderr
    record = Approvals(app).get(refund_id)
    printed = as_json(shown)
    # The record, and what approvers see: the arguments decoded from the kept message.
    assert record is not None and {**printed, "shown": None} == {**record.to_dict(),
                                                                 "shown": None}
    assert printed["shown"]["args"] == record.message.task_payload(["json"])[0]
    assert printed["shown"]["problem"] is None and len(printed["shown"]["digest"]) == 64
    assert printed["effect"] == "idempotent_write"
    human = operator(prefix, broker_url, "show", write_id)
    assert human.returncode == 0, human.stderr
    assert write_id in human.stdout and "arguments:" in human.stdout and key in human.stdout
    assert "state" in human.stdout and "pending" in human.stdout

    # The Celery sub-command is the same group.
    stats = operator(prefix, broker_url, "stats", "--json", celery=True)
    assert stats.returncode == 0, stats.stderr
    assert as_json(stats) == {
        "pending": 2,
        "by_queue": {"tools": 2},
        "by_tool": {"tools.approved_write": 1, "tools.refund": 1},
        "by_queue_and_tool": [
            {"queue": "tools", "tool": "tools.approved_write", "pending": 1},
            {"queue": "tools", "tool": "tools.refund", "pending": 1},
        ],
    }
    table = operator(prefix, broker_url, "stats")
    assert table.returncode == 0, table.stderr
    assert [line.split() for line in table.stdout.splitlines()[2:]] == [
        ["pending", "2"], ["queue", "tools", "2"], ["tool", "tools.approved_write", "1"],
        ["tool", "tools.refund", "1"]]
    assert counter.value(key) == 0 and counter.value(refund_key) == 0  # nothing ran


def test_approved_from_the_cli_runs_once_and_a_second_approval_is_refused(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    prefix: str, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    task_id = park(app, "tools.approved_write", key)

    approved = operator(prefix, broker_url, "approve", task_id, "--reason", "ticket 42",
                        "--json")
    assert approved.returncode == 0, approved.stderr
    report = as_json(approved)
    assert (report["done"], report["refused"], report["not_found"], report["failed"]) == (
        1, 0, 0, 0)
    [result] = report["results"]
    assert (result["task_id"], result["action"], result["outcome"]) == (
        task_id, "approve", "done")
    assert (result["name"], result["queue"]) == ("tools.approved_write", "tools")
    assert app.AsyncResult(task_id).get(timeout=60) == key
    assert counter.value(key) == 1

    again = operator(prefix, broker_url, "approve", task_id)  # human output
    assert again.returncode == 1
    assert "refused:" in again.stderr and "decided already: approved" in again.stderr
    assert "0 approved, 1 refused, 0 not found, 0 failed" in again.stdout
    twice = as_json(operator(prefix, broker_url, "approve", task_id, "--json"))
    assert [r["outcome"] for r in twice["results"]] == ["refused"] and twice["refused"] == 1
    assert app.AsyncResult(task_id).get(timeout=10) == key
    assert counter.value(key) == 1  # the body ran once
    record = Approvals(app).get(task_id)
    assert record is not None and record.state is ApprovalState.APPROVED
    assert decisions(app, task_id) == [("requested", "", "", ""),
                                       ("approved", "ops-cli", "ticket 42", "cli")]


def test_rejected_from_the_cli_ends_failure_and_nothing_runs(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    prefix: str, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    task_id = park(app, "tools.approved_write", key)

    rejected = operator(prefix, broker_url, "reject", task_id, "no-such-call", "--reason",
                        "not this customer", "--by", "bob", "--json")
    report = as_json(rejected)
    assert rejected.returncode == 1  # one of the two was not done
    assert [(r["task_id"], r["action"], r["outcome"]) for r in report["results"]] == [
        (task_id, "reject", "done"), ("no-such-call", "reject", "not_found")]
    assert (report["done"], report["not_found"]) == (1, 1)

    wait_for(lambda: app.AsyncResult(task_id).state == "FAILURE", timeout=60,
             what="FAILURE on the backend")
    failed = app.AsyncResult(task_id)
    assert type(failed.result).__name__ == "ApprovalRejected"
    assert "by bob: not this customer" in str(failed.result)
    assert counter.value(key) == 0  # nothing of the body ran
    assert decisions(app, task_id) == [("requested", "", "", ""),
                                       ("rejected", "bob", "not this customer", "cli")]

    def ended() -> dict[str, Any]:
        shown: dict[str, Any] = as_json(operator(prefix, broker_url, "show", task_id,
                                                 "--json"))
        return shown if shown["state"] == "ended" else {}

    shown = wait_for(ended, timeout=30, what="the worker to end the record")
    assert (shown["decided_by"], shown["reason"]) == ("bob", "not this customer")
    assert shown["decided_at"] is not None
    assert as_json(operator(prefix, broker_url, "list", "--json"))["count"] == 0


def test_decided_calls_stay_listed_by_their_decision_after_they_ran(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    prefix: str, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key, other = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    approved_id = park(app, "tools.approved_write", key)
    rejected_id = park(app, "tools.approved_write", other)
    assert operator(prefix, broker_url, "approve", approved_id).returncode == 0
    assert operator(prefix, broker_url, "reject", rejected_id, "--reason", "no").returncode == 0

    # Both were published again: a worker ran the approved call and ended the
    # rejected one, and neither waits any more.
    assert app.AsyncResult(approved_id).get(timeout=60) == key
    assert counter.value(key) == 1 and counter.value(other) == 0
    wait_for(lambda: Approvals(app).get(rejected_id).state is ApprovalState.ENDED,  # type: ignore[union-attr]
             timeout=30, what="the worker to end the rejected call")
    assert not Approvals(app).runtime.approvals.is_listed(approved_id)
    assert as_json(operator(prefix, broker_url, "list", "--json")) == {
        "approvals": [], "count": 0}

    # Listed by their decision all the same.
    approved = as_json(operator(prefix, broker_url, "list", "--state", "approved", "--json"))
    assert [a["task_id"] for a in approved["approvals"]] == [approved_id]
    [entry] = approved["approvals"]
    assert (entry["state"], entry["decided_by"], entry["name"]) == (
        "approved", "ops-cli", "tools.approved_write")
    assert entry["decided_at"] is not None and approved["count"] == 1
    rejected = as_json(operator(prefix, broker_url, "list", "--state", "rejected", "--json"))
    assert [(a["task_id"], a["state"], a["reason"]) for a in rejected["approvals"]] == [
        (rejected_id, "ended", "no")]
    assert as_json(operator(prefix, broker_url, "list", "--state", "expired", "--json"))[
        "count"] == 0
    # The filters, each from its own index.
    for filters, found in ((["--tool", "tools.approved_write"], [approved_id]),
                           (["--tool", "tools.refund"], []),
                           (["--queue", "tools", "--tool", "tools.approved_write"],
                            [approved_id]),
                           (["--queue", "elsewhere"], [])):
        listed = as_json(operator(prefix, broker_url, "list", "--state", "approved", *filters,
                                  "--json"))
        assert [a["task_id"] for a in listed["approvals"]] == found, filters

    # At 80 columns the task id and the tool are whole; --wide shows the rest.
    table = operator(prefix, broker_url, "list", "--state", "rejected", columns=80)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), table.stdout
    [row] = [line for line in lines if rejected_id in line]
    assert row.split()[:2] == [rejected_id, "tools.approved_write"]
    assert "rejected, ended" in row and lines[-1] == "1 shown"
    wide = operator(prefix, broker_url, "list", "--state", "approved", "--wide", columns=80)
    assert wide.returncode == 0, wide.stderr
    assert wide.stdout.splitlines()[0].split() == [
        "TASK", "ID", "TOOL", "QUEUE", "STATE", "WAITED", "DECIDED", "BY", "ARGUMENTS"]
    [row] = [line for line in wide.stdout.splitlines() if approved_id in line]
    assert "ops-cli" in row.split() and "args_size=" in row and "tools" in row.split()


# -- without a worker -------------------------------------------------------------------


def invoke(app: Celery, *args: str) -> Any:
    """``celery -A <app> tooleffect approvals <args>`` in this process."""
    return CliRunner().invoke(
        tooleffect, ["approvals", *args],
        obj=CLIContext(app=app, no_color=True, workdir=None),
        env={"COLUMNS": str(WIDTH), "TOOLEFFECT_ACTOR": "ops-tester"},
    )


def test_unknown_ids_and_usage_errors(make_app: Callable[..., Celery], prefix: str) -> None:
    app = make_app()
    missing = operator(prefix, REDIS_URL, "show", "no-such-call")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "no-such-call: no such approval" in missing.stderr
    assert invoke(app, "show", "no-such-call", "--json").exit_code == 1

    unknown = invoke(app, "approve", "no-such-call", "--json")
    assert unknown.exit_code == 1
    assert json.loads(unknown.stdout)["not_found"] == 1
    assert invoke(app, "list", "--json").stdout.strip() == json.dumps(
        {"approvals": [], "count": 0}, indent=2, sort_keys=True)
    assert invoke(app, "list").stdout == "No approvals match.\n"
    assert json.loads(invoke(app, "stats", "--json").stdout)["pending"] == 0

    no_reason = invoke(app, "reject", "some-call")
    assert no_reason.exit_code == 2 and "--reason" in no_reason.stderr
    blank = invoke(app, "reject", "some-call", "--reason", "  ")
    assert blank.exit_code == 2 and "needs a --reason" in blank.stderr
    assert invoke(app, "approve").exit_code == 2
    assert invoke(app, "reject", "--reason", "why").exit_code == 2
    assert invoke(app, "list", "--state", "ended").exit_code == 2
    assert invoke(app, "list", "--limit", "0").exit_code == 2
    assert invoke(app, "list", "--offset", "-1").exit_code == 2


def test_the_state_choices_are_the_listed_states() -> None:
    # From the enum (celery_tooleffect.admin.filters): the states a listed call
    # has, never absent (no record) or ended (off the list).
    params = {param.name: param.type for param in
              tooleffect.commands["approvals"].commands["list"].params}  # type: ignore[attr-defined]
    assert list(params["state"].choices) == [
        state.value for state in ApprovalState
        if state not in (ApprovalState.ABSENT, ApprovalState.ENDED)]
