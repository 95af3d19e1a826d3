"""The operator CLI against a real Redis, with dead letters made by a real worker.

Commands run through click's CliRunner (the ``tooleffect`` group, given the
test's app the way Celery gives it) and as real subprocesses (``celery -A
tests.apps.tool_app tooleffect ...`` and the ``celery-tooleffect`` script).
Each tool fails until the test "fixes" it (a flag in Redis) and counts how
many times its body ran, so a replay is seen to really run the task again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_tooleffect import AuditEvent, AuditLog, DeadLetter, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.admin.cli import tooleffect
from celery_tooleffect.admin.filters import parse_duration
from celery_tooleffect.admin.operations import DeadLetterOperations, Outcome
from celery_tooleffect.store.declarations import EffectDeclarations
from celery_tooleffect.store.envelope import MessageEnvelope
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import JournalState
from tests.conftest import (
    REDIS_URL,
    TESTS,
    Counter,
    running_worker,
    wait_acknowledged,
    wait_for,
)
from tests.letters import letter_of_call
from tests.support import TcpProxy, run_fields, run_list

WIDTH = 100
NAMES = {
    ToolEffect.READ_ONLY: "tools.read",
    ToolEffect.IDEMPOTENT_WRITE: "tools.idempotent",
    ToolEffect.NON_IDEMPOTENT_WRITE: "tools.write",
}


@dataclass
class Tools:
    app: Celery
    counter: Counter
    client: redis.Redis
    prefix: str

    def fix(self, key: str) -> None:
        """From now on the tool called with ``key`` succeeds."""
        self.client.set(f"{self.prefix}fixed:{key}", "1")

    def call(self, effect: ToolEffect, key: str, *extra: Any) -> str:
        run_id = f"run-{uuid.uuid4().hex[:8]}"
        result = self.app.send_task(
            NAMES[effect], args=[key, *extra], headers={"tooleffect_run_id": run_id}
        )
        return str(result.id)

    def dead_letter(self, effect: ToolEffect, key: str, *extra: Any) -> DeadLetter:
        """Run a failing tool through the (running) worker until it is a dead letter
        and its message is off the broker."""
        task_id = self.call(effect, key, *extra)
        letter = wait_for(lambda: DeadLetters(self.app).get(task_id), what=f"dead letter {key}")
        wait_acknowledged(self.client, self.prefix)
        return letter


@pytest.fixture
def tools(make_app: Callable[..., Celery], counter: Counter, main_redis: redis.Redis,
          prefix: str) -> Tools:
    """The names of tests/apps/tool_app.py, failing (ValueError: not retryable) until fixed."""
    app = make_app()

    def body(key: str, secret: str = "") -> str:
        counter.hit(key)
        if not main_redis.exists(f"{prefix}fixed:{key}"):
            raise ValueError(f"provider rejected {key}")
        return f"done:{key}"

    for effect, name in NAMES.items():
        app.task(base=ToolTask, effect=effect, name=name, shared=False)(body)
    return Tools(app, counter, main_redis, prefix)


def invoke(app: Celery, *args: str, width: int = WIDTH) -> Result:
    """Run ``celery -A <app> tooleffect <args>`` in this process."""
    return CliRunner().invoke(
        tooleffect, list(args), obj=CLIContext(app=app, no_color=True, workdir=None),
        env={"COLUMNS": str(width), "TOOLEFFECT_ACTOR": "ops-tester"},
    )


def as_json(result: Result) -> Any:
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def succeeded(app: Celery, task_id: str) -> None:
    """Wait until the result backend says SUCCESS (a fresh AsyncResult each time:
    one that saw FAILURE keeps it)."""
    wait_for(lambda: app.AsyncResult(task_id).state == "SUCCESS",
             what=f"{task_id} to succeed")


def events_of(app: Celery, run_id: str) -> list[AuditEvent]:
    return AuditLog(app).events(run_id)


def journal_state(app: Celery, letter: DeadLetter) -> dict[str, str]:
    return runtime_for(app).journal.read(JournalRef(letter.run_id, letter.task_id))


def subprocess_env(prefix: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TE_PREFIX=prefix, TE_BROKER=REDIS_URL, PYTHONPATH=str(TESTS.parent),
               COLUMNS=str(WIDTH), TOOLEFFECT_ACTOR="ops-subprocess")
    return env


# -- list, show, stats -------------------------------------------------------------------


def test_list_show_and_stats_of_real_dead_letters(tools: Tools) -> None:
    app = tools.app
    with running_worker(app):
        read = tools.dead_letter(ToolEffect.READ_ONLY, "r1", "s3cr3t-arg")
        idem = tools.dead_letter(ToolEffect.IDEMPOTENT_WRITE, "i1")
        write = tools.dead_letter(ToolEffect.NON_IDEMPOTENT_WRITE, "w1")

    # JSON: the documented fields, newest first; at the default privacy level
    # no argument value and no error message is listed, only their sizes.
    listed = invoke(app, "dlq", "list", "--json")
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.stdout)
    assert set(data) == {"dead_letters", "next_cursor", "total"}
    assert data["total"] == 3 and data["next_cursor"] is None
    ids = [entry["task_id"] for entry in data["dead_letters"]]
    assert ids == [write.task_id, idem.task_id, read.task_id]
    first = data["dead_letters"][2]
    assert {"task_id", "name", "queue", "reason", "failure_class", "effect", "exception_type",
            "attempts", "worker", "run_id", "body_completed", "late_outcomes",
            "dead_lettered_at", "args_size", "kwargs_size", "error_size"} <= set(first)
    assert first["reason"] == "not_retryable" and first["failure_class"] == "unknown"
    assert first["effect"] == "read_only" and first["queue"] == "tools"
    assert "args" not in first and "error" not in first
    assert "s3cr3t-arg" not in listed.stdout

    # Filters: each one, and several together.
    only_writes = as_json(invoke(app, "dlq", "list", "--json", "--effect", "non_idempotent_write"))
    assert [entry["task_id"] for entry in only_writes["dead_letters"]] == [write.task_id]
    assert only_writes["total"] == 1
    both = as_json(invoke(app, "dlq", "list", "--json", "--queue", "tools",
                          "--dead-letter-reason", "not_retryable", "--failure-class",
                          "unknown", "--effect", "idempotent_write"))
    assert [entry["task_id"] for entry in both["dead_letters"]] == [idem.task_id]
    none = invoke(app, "dlq", "list", "--queue", "elsewhere")
    assert none.exit_code == 0 and "No dead letters match." in none.stdout

    # Human output: an aligned table no wider than the terminal, task ids whole.
    table = invoke(app, "dlq", "list")
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].startswith("TASK ID") and set(lines[1]) <= {"-", " "}
    assert all(len(line) <= WIDTH for line in lines), table.stdout
    for letter in (read, idem, write):
        assert letter.task_id in table.stdout
    assert "3 shown of 3" in table.stdout
    wide = invoke(app, "dlq", "list", width=200)
    assert "EXCEPTION" in wide.stdout and "ValueError" in wide.stdout

    # Show: the whole envelope (a replay needs it) and the replay rules.
    shown = as_json(invoke(app, "dlq", "show", read.task_id, "--json"))
    assert set(shown) == {"dead_letter", "journal", "replay_in_progress", "replay",
                          "reconcile"}
    assert "declares no reconcile" in shown["reconcile"]["refusal"]
    assert shown["dead_letter"]["args"] == ["r1", "s3cr3t-arg"]
    assert shown["journal"] is None  # READ_ONLY keeps no journal
    assert shown["replay"] == {"allowed": True, "needs_force": False, "bulk": True,
                               "refusal": None}
    shown_write = as_json(invoke(app, "dlq", "show", write.task_id, "--json"))
    assert shown_write["journal"]["state"] == "dead_lettered"
    assert shown_write["replay"]["allowed"] is False
    assert shown_write["replay"]["needs_force"] is True
    assert "NON_IDEMPOTENT_WRITE" in shown_write["replay"]["refusal"]
    human = invoke(app, "dlq", "show", write.task_id)
    assert human.exit_code == 0
    assert "only with --force and a --reason" in human.stdout
    assert all(len(line) <= WIDTH for line in human.stdout.splitlines())

    missing = invoke(app, "dlq", "show", "no-such-task")
    assert missing.exit_code == 1 and "no such dead letter" in missing.stderr
    assert invoke(app, "dlq", "show", "no-such-task", "--json").exit_code == 1

    # Stats: counts by queue, reason, failure class and effect.
    stats = as_json(invoke(app, "dlq", "stats", "--json"))
    assert stats == {
        "total": 3,
        "by_queue": {"tools": 3},
        "by_reason": {"not_retryable": 3},
        "by_failure_class": {"unknown": 3},
        "by_effect": {"read_only": 1, "idempotent_write": 1, "non_idempotent_write": 1},
        "replay_pending": 0,
        "by_combination": [
            {"queue": "tools", "reason": "not_retryable", "failure_class": "unknown",
             "effect": effect, "count": 1}
            for effect in ("idempotent_write", "non_idempotent_write", "read_only")],
    }
    human_stats = invoke(app, "dlq", "stats")
    assert human_stats.exit_code == 0
    assert any(line.split() == ["total", "3"] for line in human_stats.stdout.splitlines())
    assert any(line.split() == ["effect", "read_only", "1"]
               for line in human_stats.stdout.splitlines())


def test_list_pages_with_a_cursor(tools: Tools) -> None:
    app = tools.app
    letters = DeadLetters(app)
    base = time.time()
    stored = []
    for number in range(7):
        letter = DeadLetter(
            task_id=f"page-{number}", name="tools.read", queue="tools", reason="not_retryable",
            failure_class="unknown", effect="read_only", run_id=f"run-{number}",
            # Two pairs share a time: the cursor must still be exact.
            dead_lettered_at=base + number // 2,
        )
        assert letters.store(letter)
        stored.append(letter.task_id)

    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        args = ["dlq", "list", "--json", "--limit", "3"] + (["--cursor", cursor] if cursor else [])
        page = as_json(invoke(app, *args))
        seen += [entry["task_id"] for entry in page["dead_letters"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert sorted(seen) == sorted(stored) and len(seen) == len(set(seen))
    times = [letters.get(task_id).dead_lettered_at for task_id in seen]  # type: ignore[union-attr]
    assert times == sorted(times, reverse=True)
    text = invoke(app, "dlq", "list", "--limit", "3")
    assert "next page: --cursor" in text.stdout
    assert invoke(app, "dlq", "list", "--cursor", "garbage").exit_code == 2


# -- replay ------------------------------------------------------------------------------


@pytest.mark.parametrize("effect", [ToolEffect.READ_ONLY, ToolEffect.IDEMPOTENT_WRITE])
def test_replayed_task_runs_again_through_a_real_worker_and_succeeds(
    tools: Tools, effect: ToolEffect
) -> None:
    app = tools.app
    with running_worker(app):
        letter = tools.dead_letter(effect, "flaky")
        assert tools.counter.value("flaky") == 1
        tools.fix("flaky")

        replayed = invoke(app, "dlq", "replay", letter.task_id, "--reason", "provider fixed")
        assert replayed.exit_code == 0, replayed.output
        assert f"replayed {effect_name(effect)}[{letter.task_id}]" in replayed.stdout

        succeeded(app, letter.task_id)
        assert app.AsyncResult(letter.task_id).result == "done:flaky"
    assert tools.counter.value("flaky") == 2
    assert DeadLetters(app).get(letter.task_id) is None
    assert as_json(invoke(app, "dlq", "stats", "--json"))["total"] == 0

    events = events_of(app, letter.run_id)
    replay = [event for event in events if event["phase"] == "replayed"]
    assert len(replay) == 1
    assert replay[0]["actor"] == "ops-tester" and replay[0]["reason"] == "provider fixed"
    assert replay[0]["task_id"] == letter.task_id and float(replay[0]["ts"]) > 0
    assert replay[0]["via"] == "cli"
    if effect.is_write:
        # The journal was reset: the replayed run is attempt 1 again, and it
        # ends succeeded.
        journal = journal_state(app, letter)
        assert journal["state"] == "succeeded" and journal["attempt"] == "1"
        assert journal["replays"] == "1" and journal["attempts_before_replay"] == "1"
        after = events[events.index(replay[0]) + 1:]
        assert [(e["phase"], e["status"], e.get("attempt")) for e in after][:2] == [
            ("intent", "started", "1"), ("outcome", "succeeded", "1")]


def effect_name(effect: ToolEffect) -> str:
    return NAMES[effect]


def test_replay_resets_the_attempt_budget(tools: Tools) -> None:
    """A replayed write may spend the whole budget again (max_retries 2 here)."""
    app = tools.app
    with running_worker(app):
        letter = tools.dead_letter(ToolEffect.IDEMPOTENT_WRITE, "budget")
        ref = JournalRef(letter.run_id, letter.task_id)
        journal = runtime_for(app).journal
        # As if every attempt of the budget had been spent before.
        journal.client.hset(journal.keys.journal(ref.run_id, ref.task_id), "attempt", "3")
        tools.fix("budget")
        assert invoke(app, "dlq", "replay", letter.task_id).exit_code == 0
        succeeded(app, letter.task_id)
    assert journal.read(ref)["attempt"] == "1"
    assert journal.read(ref)["attempts_before_replay"] == "3"


def test_bulk_replay_skips_non_idempotent_writes(tools: Tools) -> None:
    app = tools.app
    with running_worker(app):
        read = tools.dead_letter(ToolEffect.READ_ONLY, "b-read")
        idem = tools.dead_letter(ToolEffect.IDEMPOTENT_WRITE, "b-idem")
        write = tools.dead_letter(ToolEffect.NON_IDEMPOTENT_WRITE, "b-write")
        for key in ("b-read", "b-idem", "b-write"):
            tools.fix(key)

        bulk = invoke(app, "dlq", "replay", "--all", "--queue", "tools", "--json",
                      "--reason", "nightly")
        assert bulk.exit_code == 1, bulk.output  # something was refused
        summary = json.loads(bulk.stdout)
        assert (summary["done"], summary["refused"]) == (2, 1)
        by_id = {entry["task_id"]: entry for entry in summary["results"]}
        assert by_id[write.task_id]["outcome"] == "refused"
        assert "never in bulk" in by_id[write.task_id]["message"]
        for letter in (read, idem):
            succeeded(app, letter.task_id)
    assert tools.counter.value("b-write") == 1
    assert DeadLetters(app).get(write.task_id) is not None
    assert DeadLetters(app).get(read.task_id) is None

    # Filters pick what is replayed: nothing of another effect is touched.
    again = invoke(app, "dlq", "replay", "--all", "--effect", "read_only")
    assert again.exit_code == 0 and "0 replayed" in again.stdout


def test_non_idempotent_write_needs_force_and_a_reason(tools: Tools) -> None:
    app = tools.app
    with running_worker(app):
        write = tools.dead_letter(ToolEffect.NON_IDEMPOTENT_WRITE, "nw")
        tools.fix("nw")

        plain = invoke(app, "dlq", "replay", write.task_id)
        assert plain.exit_code == 1
        assert "NON_IDEMPOTENT_WRITE" in plain.stderr and "--force" in plain.stderr
        assert DeadLetters(app).get(write.task_id) is not None

        # Usage errors: exit code 2, nothing done.
        assert invoke(app, "dlq", "replay", write.task_id, "--force").exit_code == 2
        assert invoke(app, "dlq", "replay", write.task_id, "other", "--force",
                      "--reason", "x").exit_code == 2
        assert invoke(app, "dlq", "replay", "--all", "--force", "--reason", "x").exit_code == 2
        assert invoke(app, "dlq", "replay").exit_code == 2
        assert invoke(app, "dlq", "replay", write.task_id, "--all").exit_code == 2
        assert journal_state(app, write)["state"] == "dead_lettered"

        forced = invoke(app, "dlq", "replay", write.task_id, "--force", "--reason",
                        "customer confirmed nothing was sent")
        assert forced.exit_code == 0, forced.output
        succeeded(app, write.task_id)
    assert tools.counter.value("nw") == 2
    # The run's page counts both bodies (the replay's attempt numbers start
    # again at 1) and tells how the call ended, not how its first run did.
    [call] = as_json(invoke(app, "runs", "show", write.run_id, "--json"))["calls"]
    assert (call["state"], call["bodies"], call["attempts"]) == ("succeeded", 2, 1)
    assert call["failure_class"] is None and call["dead_letter_reason"] is None
    shown = invoke(app, "runs", "show", write.run_id, "--wide")
    [row] = [line for line in shown.stdout.splitlines() if write.task_id in line]
    assert "RUNS" in shown.stdout.splitlines()[0]
    words = row.split()[-6:]
    assert words[:3] + words[4:] == ["non_idempotent_write", "succeeded", "2",
                                     "outcome", "succeeded"], row
    # The table rounds the duration to 0.1 ms, --json to 0.001 ms: the same
    # duration within the two roundings (2.9496 shows 2.9, its JSON 2.95).
    assert abs(float(words[3]) - call["duration_ms"]) <= 0.0505, row
    replay = [e for e in events_of(app, write.run_id) if e["phase"] == "replayed"]
    assert replay[0]["forced"] == "1"
    assert replay[0]["reason"] == "customer confirmed nothing was sent"

    # Its outcome is recorded now: replaying it again is refused, even forced.
    assert DeadLetters(app).get(write.task_id) is None
    DeadLetters(app).store(write)  # as if someone restored the old letter
    refused = invoke(app, "dlq", "replay", write.task_id, "--force", "--reason", "again")
    assert refused.exit_code == 1
    assert "outcome was recorded (journal: succeeded)" in refused.stderr
    assert "the write ran" in refused.stderr
    assert DeadLetters(app).get(write.task_id) is not None


def test_a_write_whose_body_completed_says_it_already_ran(tools: Tools) -> None:
    app = tools.app
    letters = DeadLetters(app)
    for effect in (ToolEffect.IDEMPOTENT_WRITE, ToolEffect.NON_IDEMPOTENT_WRITE):
        letter = letter_of_call(
            app, task_id=f"completed-{effect.value}", name=NAMES[effect],
            args=[f"done-{effect.value}"], run_id=f"run-completed-{effect.value}",
            reason="not_retryable", failure_class="unknown", effect=effect.value,
            exception_type="AuditPersistenceFailed", body_completed=True,
        )
        letters.store(letter)
        plain = invoke(app, "dlq", "replay", letter.task_id)
        assert plain.exit_code == 1
        assert plain.stderr.startswith("refused: the write already ran:"), plain.stderr
        assert "Only --force with a --reason overrides this." in plain.stderr
        bulk = invoke(app, "dlq", "replay", "--all", "--effect", effect.value)
        assert bulk.exit_code == 1
        assert letters.get(letter.task_id) is not None

        tools.fix(f"done-{effect.value}")
        with running_worker(app):
            forced = invoke(app, "dlq", "replay", letter.task_id, "--force", "--reason",
                            "the outcome was lost, the provider shows nothing")
            assert forced.exit_code == 0, forced.output
            succeeded(app, letter.task_id)


def test_a_late_outcome_refuses_the_replay_of_a_non_idempotent_write(tools: Tools) -> None:
    app = tools.app
    runtime = runtime_for(app)
    with running_worker(app):
        on_letter = tools.dead_letter(ToolEffect.NON_IDEMPOTENT_WRITE, "late-a")
        in_stream = tools.dead_letter(ToolEffect.NON_IDEMPOTENT_WRITE, "late-b")

    # A worker that had lost its lease finished the write after all: its
    # outcome is copied onto the letter ...
    late = {"phase": "late_outcome", "late_phase": "outcome", "status": "succeeded"}
    assert runtime.dead_letters.record_late_outcome(on_letter.task_id, late)
    # ... or is only in the run's audit stream (it came before the letter).
    moved = runtime.journal.transition(
        JournalRef(in_stream.run_id, in_stream.task_id), new_state=JournalState.SUCCEEDED,
        allowed=frozenset({JournalState.RUNNING}), token="the-old-owner",
        event=AuditEvent.of(run_id=in_stream.run_id, task_id=in_stream.task_id,
                            tool=in_stream.name, effect=in_stream.effect, phase="outcome",
                            status="succeeded", worker="old-owner:1", queue=in_stream.queue),
    )
    assert not moved  # stored as a late_outcome event

    for letter in (on_letter, in_stream):
        refused = invoke(app, "dlq", "replay", letter.task_id, "--force", "--reason", "try")
        assert refused.exit_code == 1, refused.output
        assert "outcome was recorded (late outcome: succeeded)" in refused.stderr
        assert DeadLetters(app).get(letter.task_id) is not None
        assert journal_state(app, letter)["state"] == "dead_lettered"
    assert tools.counter.value("late-a") == tools.counter.value("late-b") == 1


def test_an_undecodable_message_cannot_be_replayed(tools: Tools) -> None:
    app = tools.app
    letter = DeadLetter(
        task_id="undecodable-1", name="", queue="tools", reason="undecodable_message",
        failure_class="client_error", effect="non_idempotent_write",
        message=MessageEnvelope(body=b"\x00garbage", content_type=None, content_encoding=None,
                                routing_key="tools"),
        run_id="undecodable-1",
    )
    DeadLetters(app).store(letter)
    refused = invoke(app, "dlq", "replay", letter.task_id, "--force", "--reason", "x")
    assert refused.exit_code == 1 and "cannot be replayed" in refused.stderr


def test_two_operators_replaying_at_once_publish_once(tools: Tools) -> None:
    app = tools.app
    with running_worker(app):
        letter = tools.dead_letter(ToolEffect.READ_ONLY, "race")
    operations = DeadLetterOperations(app)
    results: list[Any] = []
    barrier = threading.Barrier(4)

    def replay() -> None:
        barrier.wait()
        results.append(operations.replay(letter.task_id, actor="racer"))

    threads = [threading.Thread(target=replay) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    outcomes = sorted(result.outcome.value for result in results)
    assert outcomes.count(Outcome.DONE.value) == 1, outcomes
    replays = [e for e in events_of(app, letter.run_id) if e["phase"] == "replayed"]
    assert len(replays) == 1
    # Exactly one message was published again.
    queue_key = f"{tools.prefix}tools"
    assert tools.client.llen(queue_key) == 1


# -- purge -------------------------------------------------------------------------------


def test_purge_is_confirmed_and_audited(tools: Tools) -> None:
    app = tools.app
    with running_worker(app):
        first = tools.dead_letter(ToolEffect.IDEMPOTENT_WRITE, "p1")
        second = tools.dead_letter(ToolEffect.READ_ONLY, "p2")
        third = tools.dead_letter(ToolEffect.NON_IDEMPOTENT_WRITE, "p3")

    unconfirmed = invoke(app, "dlq", "purge", first.task_id)
    assert unconfirmed.exit_code == 1 and "pass --yes" in unconfirmed.stderr
    assert DeadLetters(app).get(first.task_id) is not None

    purged = invoke(app, "dlq", "purge", first.task_id, "--yes", "--reason", "handled by hand")
    assert purged.exit_code == 0, purged.output
    assert DeadLetters(app).get(first.task_id) is None
    event = [e for e in events_of(app, first.run_id) if e["phase"] == "purged"]
    assert event and event[0]["actor"] == "ops-tester"
    assert event[0]["reason"] == "handled by hand"
    # The journal keeps its state: a stray copy of the message still does not run.
    assert journal_state(app, first)["state"] == "dead_lettered"

    assert invoke(app, "dlq", "purge", first.task_id, "--yes").exit_code == 1  # not found
    assert invoke(app, "dlq", "purge", "--all", "--yes").exit_code == 2  # needs --older-than
    assert invoke(app, "dlq", "purge", "--all", "--older-than", "soon").exit_code == 2
    assert invoke(app, "dlq", "purge", second.task_id, "--older-than", "1h").exit_code == 2

    young = invoke(app, "dlq", "purge", "--all", "--older-than", "1h", "--yes")
    assert young.exit_code == 0 and "No dead letters match." in young.stdout
    assert as_json(invoke(app, "dlq", "stats", "--json"))["total"] == 2

    filtered = invoke(app, "dlq", "purge", "--all", "--older-than", "0s", "--effect",
                      "read_only", "--yes", "--json")
    assert filtered.exit_code == 0
    assert json.loads(filtered.stdout)["done"] == 1
    assert DeadLetters(app).get(second.task_id) is None
    assert DeadLetters(app).get(third.task_id) is not None
    assert as_json(invoke(app, "dlq", "stats", "--json"))["by_effect"] == {
        "non_idempotent_write": 1}


def test_durations() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("2h") == 7200
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("1w") == 604800
    with pytest.raises(ValueError):
        parse_duration("a while")


def test_usage_errors_exit_2(tools: Tools) -> None:
    app = tools.app
    assert invoke(app, "dlq", "list", "--limit", "0").exit_code == 2
    assert invoke(app, "dlq", "list", "--dead-letter-reason", "bored").exit_code == 2
    # --reason is the why of a replay or purge, never a filter: list points to the filter.
    renamed = invoke(app, "dlq", "list", "--reason", "not_retryable")
    assert renamed.exit_code == 2 and "--dead-letter-reason" in renamed.stderr
    assert "--reason" not in invoke(app, "dlq", "list", "--help").stdout
    short = invoke(app, "dlq", "list", "-r", "not_retryable")
    assert short.exit_code == 2 and "No such option" in short.stderr
    assert invoke(app, "dlq", "nothing").exit_code == 2
    assert invoke(app, "audit", "show").exit_code == 2


def test_the_cli_filter_choices_are_the_enums() -> None:
    # The choices come from the enums (celery_tooleffect.admin.filters, shared with
    # Flower's filters): every command's filter offers every value, in the enum's order.
    from celery_tooleffect.failures import FailureClass
    from celery_tooleffect.store.dead_letters import DeadLetterReason

    for name in ("list", "replay", "purge", "reconcile"):
        params = {param.name: param.type for param in
                  tooleffect.commands["dlq"].commands[name].params}  # type: ignore[attr-defined]
        assert list(params["dead_letter_reason"].choices) == [r.value for r in DeadLetterReason]
        assert list(params["failure_class"].choices) == [c.value for c in FailureClass]
        assert list(params["effect"].choices) == [e.value for e in ToolEffect]


# -- audit -------------------------------------------------------------------------------


def test_audit_show_and_tail(tools: Tools) -> None:
    app = tools.app
    tools.fix("audited")
    with running_worker(app):
        task_id = tools.call(ToolEffect.IDEMPOTENT_WRITE, "audited")
        succeeded(app, task_id)
    events = [e for e in AuditLog(app).tail(50) if e.get("task_id") == task_id]
    run_id = events[0]["run_id"]

    shown = invoke(app, "audit", "show", run_id)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0].endswith(" (UTC)") and lines[1].startswith("UTC ")
    assert all(len(line) <= WIDTH for line in lines)
    assert any("intent" in line and "started" in line for line in lines)
    assert any("outcome" in line and "succeeded" in line for line in lines)
    data = as_json(invoke(app, "audit", "show", run_id, "--json"))
    assert data["run_id"] == run_id
    assert [e["phase"] for e in data["events"]] == ["intent", "outcome"]
    assert invoke(app, "audit", "show", "no-such-run").exit_code == 1

    tail = invoke(app, "audit", "tail", "--count", "5")
    assert tail.exit_code == 0 and run_id in tail.stdout
    tail_json = invoke(app, "audit", "tail", "--count", "2", "--json")
    assert [json.loads(line)["phase"] for line in tail_json.stdout.splitlines()] == [
        "intent", "outcome"]


def test_audit_tail_follows_new_events(tools: Tools, prefix: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "celery_tooleffect.admin.cli", "-A", "tests.apps.tool_app",
         "audit", "tail", "--follow", "--count", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(prefix), cwd=str(TESTS.parent),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")),
                              daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(lambda: lines, timeout=30, what="the tail's header")
        run_id = f"followed-{uuid.uuid4().hex[:8]}"
        for _ in range(50):  # until the follower (already blocking on XREAD) prints it
            AuditLog(tools.app).record_step(AuditEvent.of(
                run_id=run_id, task_id="t", tool="x", effect="read_only", phase="note",
                status="seen", worker="test:1", queue="tools"))
            if any(run_id in line for line in lines):
                break
            time.sleep(0.2)
        wait_for(lambda: any(run_id in line for line in lines), timeout=10,
                 what="the followed event")
    finally:
        # Ctrl-C: the tail ends (exit 0). It cannot if it was started with
        # SIGINT ignored (see pytest_configure in tests/conftest.py).
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()  # not left running after the test
            process.wait(10)
            raise
    assert code == 0, process.stderr.read() if process.stderr else ""


# -- real processes ----------------------------------------------------------------------


def test_celery_subcommand_and_console_script_in_subprocesses(
    tools: Tools, prefix: str
) -> None:
    app = tools.app
    with running_worker(app):
        letter = tools.dead_letter(ToolEffect.IDEMPOTENT_WRITE, "sub")
    env = subprocess_env(prefix)

    listed = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect", "dlq",
         "list"],
        env=env, cwd=str(TESTS.parent), capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert letter.task_id in listed.stdout
    assert all(len(line) <= WIDTH for line in listed.stdout.splitlines())

    as_data = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect", "dlq",
         "list", "--json"],
        env=env, cwd=str(TESTS.parent), capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert [e["task_id"] for e in json.loads(as_data.stdout)["dead_letters"]] == [
        letter.task_id]

    script = Path(sys.executable).with_name("celery-tooleffect")
    command = [str(script)] if script.exists() else [sys.executable, "-m",
                                                     "celery_tooleffect.admin.cli"]
    stats = subprocess.run(
        [*command, "-A", "tests.apps.tool_app", "dlq", "stats", "--json"],
        env=env, cwd=str(TESTS.parent), capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["by_effect"] == {"idempotent_write": 1}

    missing = subprocess.run(
        [*command, "-A", "tests.apps.tool_app", "dlq", "show", "nope"],
        env=env, cwd=str(TESTS.parent), capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert missing.returncode == 1 and "no such dead letter" in missing.stderr
    usage = subprocess.run(
        [*command, "dlq", "list"], env=env, cwd=str(TESTS.parent), capture_output=True,
        text=True, timeout=60, check=False,
    )
    assert usage.returncode == 2 and "-A" in usage.stderr


def test_bulk_replay_and_purge_go_by_batch_and_keep_each_letter_audited(
    make_app: Callable[..., Celery], counter: Counter, main_redis: redis.Redis, prefix: str,
) -> None:
    """A bulk action reads, takes, records and forgets a whole batch of letters in
    one round trip per step; only the publishes go one by one. Each letter is
    still taken atomically, audited once, and its message published unchanged."""
    with TcpProxy(main_redis.connection_pool.connection_kwargs["port"]) as proxy:
        app = make_app(broker_url=proxy.url(), result_backend=proxy.url())
        tools = Tools(app, counter, main_redis, prefix)

        def body(key: str) -> str:
            raise ValueError(f"provider rejected {key}")

        for effect, name in NAMES.items():
            app.task(base=ToolTask, effect=effect, name=name, shared=False)(body)
        reads = [f"bulk-read-{i}" for i in range(14)]
        idempotent = [f"bulk-idem-{i}" for i in range(8)]
        writes = [f"bulk-write-{i}" for i in range(3)]
        with running_worker(app):
            ids = {key: tools.call(ToolEffect.READ_ONLY, key) for key in reads}
            ids |= {key: tools.call(ToolEffect.IDEMPOTENT_WRITE, key) for key in idempotent}
            ids |= {key: tools.call(ToolEffect.NON_IDEMPOTENT_WRITE, key) for key in writes}
            letters = {key: wait_for(lambda task_id=task_id: DeadLetters(app).get(task_id),
                                     what=f"dead letter {key}") for key, task_id in ids.items()}
            wait_acknowledged(main_redis, prefix)
        bodies = {letter.task_id: letter.message.body  # type: ignore[union-attr]
                  for letter in letters.values()}

        before = proxy.round_trips
        purged = invoke(app, "dlq", "purge", "--all", "--older-than", "0s", "--effect",
                        "read_only", "--yes", "--json")
        purge_trips = proxy.round_trips - before
        assert json.loads(purged.stdout)["done"] == len(reads), purged.output

        before = proxy.round_trips
        bulk = invoke(app, "dlq", "replay", "--all", "--json", "--reason", "nightly")
        replay_trips = proxy.round_trips - before
        summary = json.loads(bulk.stdout)
        assert (summary["done"], summary["refused"]) == (len(idempotent), len(writes)), bulk.output

    # A batch costs a constant: its pages (walked twice: counted, then acted
    # on), then one round trip per step (read 2, take, journal resets and
    # their global copies, the reads' events, forget); a replay adds one
    # publish per letter. Measured here: 13 for the purge, 8 + 10 for the
    # replay. The bound leaves room for connecting and redis-py's health-check
    # PINGs of connections idle for 30 s (a slow machine); one by one it was
    # five or six per letter: at least 70 for the purge, 48 + 8 for the replay.
    per_batch = 30
    direct = make_app()  # the proxy is gone: read the same keys without it
    assert purge_trips <= per_batch, purge_trips
    assert replay_trips <= len(idempotent) + per_batch, replay_trips
    for key in reads:
        letter = letters[key]
        phases = [e["phase"] for e in events_of(direct, letter.run_id)]
        assert phases.count("purged") == 1 and "replayed" not in phases
        assert DeadLetters(direct).get(letter.task_id) is None
    queued = main_redis.lrange(f"{prefix}tools", 0, -1)
    published = {json.loads(raw)["headers"]["id"]: base64.b64decode(json.loads(raw)["body"])
                 for raw in queued}
    assert set(published) == {ids[key] for key in idempotent}
    for key in idempotent:
        letter = letters[key]
        assert published[letter.task_id] == bodies[letter.task_id]  # the bytes, unchanged
        phases = [e["phase"] for e in events_of(direct, letter.run_id)]
        assert phases.count("replayed") == 1
        assert DeadLetters(direct).get(letter.task_id) is None
        assert journal_state(direct, letter)["state"] == JournalState.REPLAYED.value
    for key in writes:  # refused in bulk: kept as they were
        letter = letters[key]
        assert DeadLetters(direct).get(letter.task_id) is not None
        assert journal_state(direct, letter)["state"] == "dead_lettered"
    assert DeadLetters(direct).stats().total == len(writes)
    assert not main_redis.hlen(DeadLetters(app).keys.dead_letter_replaying)


# -- readable at 80 columns ------------------------------------------------------------

LONG_TOOL = "billing.tools.send_invoice_email"


def test_tables_keep_task_ids_and_tool_names_whole_at_80_columns(tools: Tools) -> None:
    app = tools.app
    letters = DeadLetters(app)
    stored = []
    for number, name in enumerate([LONG_TOOL, "tools.read", "crm.sync_contact"]):
        letter = DeadLetter(
            task_id=str(uuid.uuid4()), name=name, queue="tools", reason="retries_exhausted",
            failure_class="connection", effect="non_idempotent_write", run_id=f"run-{number}",
            exception_type="ConnectionRefusedError", attempts=4,
        )
        assert letters.store(letter)
        stored.append(letter)

    table = invoke(app, "dlq", "list", width=80)
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), table.stdout
    for letter in stored:
        [row] = [line for line in lines if letter.task_id in line]
        # What an operator reads first: the reason and the class whole, the
        # exception cut; the task id whole, never "3f2a…".
        cells = row.split()
        assert cells[:3] == [letter.task_id, "retries_exhausted", "connection"]
        assert cells[3].startswith("Connect") and cells[3].endswith("…")
        # The tool does not fit whole beside them: left out, never cut.
        assert not any(cell.startswith("billing") for cell in cells)
    assert any(line.startswith("Not shown:") and "TOOL" in line for line in lines)
    assert "--wide" in table.stdout and lines[-1] == "3 shown of 3"
    # With room for it, the tool is there, whole.
    roomy = invoke(app, "dlq", "list", width=120)
    for letter in stored:
        [row] = [line for line in roomy.stdout.splitlines() if letter.task_id in line]
        assert letter.name in row.split() and "retries_exhausted" in row.split()

    wide = invoke(app, "dlq", "list", "--wide", width=80)
    assert wide.exit_code == 0, wide.output
    header = wide.stdout.splitlines()[0]
    for column in ("TASK ID", "STORED (UTC)", "QUEUE", "TOOL", "EFFECT", "REASON", "CLASS",
                   "TRY", "EXCEPTION"):
        assert column in header
    for letter in stored:
        [row] = [line for line in wide.stdout.splitlines() if letter.task_id in line]
        for value in (letter.name, "tools", "non_idempotent_write", "retries_exhausted",
                      "connection", "ConnectionRefusedError"):
            assert value in row.split()
    assert max(len(line) for line in wide.stdout.splitlines()) > 80
    assert "Not shown" not in wide.stdout and "…" not in wide.stdout

    stats = invoke(app, "dlq", "stats", "--wide", width=80)
    assert stats.exit_code == 0, stats.output
    assert "tools/retries_exhausted/connection/non_idempotent_write" in stats.stdout


def test_audit_tables_keep_task_ids_and_tool_names_whole_at_80_columns(tools: Tools) -> None:
    app = tools.app
    audit = AuditLog(app)
    run_id = f"run-{uuid.uuid4()}"
    task_ids = [str(uuid.uuid4()) for _ in range(2)]
    # 36 + 18 and the phase and status: at 80 columns, what else fits is left out.
    tool = "tools.send_invoice"
    for task_id in task_ids:
        for phase, status in (("intent", "started"), ("outcome", "succeeded")):
            assert audit.record_step(AuditEvent.of(
                run_id=run_id, task_id=task_id, tool=tool,
                effect=ToolEffect.NON_IDEMPOTENT_WRITE, phase=phase, status=status,
                worker="celery@a-rather-long-worker-hostname:4242", queue="tools", attempt=1,
                failure_class="connection", exception_type="ConnectionRefusedError"))

    shown = invoke(app, "audit", "show", run_id, width=80)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), shown.stdout
    # The time is kept (HH:MM:SS under the day, all the events being of one
    # day), the task id, the phase and the status; the tool when it fits.
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \(UTC\)", lines[0])
    for task_id in task_ids:
        rows = [line for line in lines if task_id in line]
        assert len(rows) == 2
        for row, phase in zip(rows, ("intent", "outcome"), strict=True):
            cells = row.split()
            at = cells.index(task_id)
            assert re.fullmatch(r"\d{2}:\d{2}:\d{2}", cells[at - 1])
            assert cells[at + 1] == phase
    assert any(line.startswith("Not shown:") for line in lines)
    roomy = invoke(app, "audit", "show", run_id, width=100)
    assert all(tool in line.split() for line in roomy.stdout.splitlines() if task_ids[0] in line)
    wide_show = invoke(app, "audit", "show", run_id, "--wide", width=80)
    assert "celery@a-rather-long-worker-hostname:4242" in wide_show.stdout
    assert "ConnectionRefusedError" in wide_show.stdout and "TIME (UTC)" in wide_show.stdout

    tail = invoke(app, "audit", "tail", "--count", "4", width=80)
    assert tail.exit_code == 0, tail.output
    lines = tail.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), tail.stdout
    for task_id in task_ids:
        rows = [line for line in lines if task_id in line]
        assert len(rows) == 2 and all(tool in row.split() for row in rows)
    wide_tail = invoke(app, "audit", "tail", "--count", "4", "--wide", width=80)
    assert run_id in wide_tail.stdout and "RUN ID" in wide_tail.stdout
    assert all(run_id in line for line in wide_tail.stdout.splitlines()[2:])


def test_the_tools_table_keeps_tool_names_whole_at_80_columns(tools: Tools) -> None:
    app = tools.app
    declarations = EffectDeclarations(runtime_for(app).settings)
    names = [LONG_TOOL, "tools.read_the_customer_record_from_the_crm"]
    for number in range(3):
        declarations.publish(f"celery@worker-{number}.eu-west-1.compute.internal",
                             release="2026.12.3-rc1", ttl=60,
                             tools={names[0]: "non_idempotent_write", names[1]: "read_only"})
    table = invoke(app, "tools", width=80)
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), table.stdout
    for name in names:
        assert any(line.split()[:1] == [name] for line in lines), table.stdout
    wide = invoke(app, "tools", "--wide", width=80)
    assert "DECLARED BY" in wide.stdout
    assert "celery@worker-2.eu-west-1.compute.internal" in wide.stdout


# -- audit JSON: the stored fields, byte for byte ---------------------------------------


def test_audit_json_is_the_stored_fields(tools: Tools, main_redis: redis.Redis) -> None:
    app = tools.app
    audit = AuditLog(app)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    assert audit.record_step(AuditEvent.of(
        run_id=run_id, task_id="t-1", tool="tools.read", effect=ToolEffect.READ_ONLY,
        phase="outcome", status="succeeded", worker="w:1", queue="tools", attempt=2,
        duration_ms=1.5, redelivered=True, result_size=12, note="é"))
    assert audit.record_step(AuditEvent.of(
        run_id=run_id, task_id="t-2", tool="tools.read", effect=ToolEffect.READ_ONLY,
        phase="note", status="kept", worker="w:1", queue="tools"))

    def decoded(entries: Any) -> list[dict[str, str]]:
        return [{"id": entry_id.decode(), **{k.decode(): v.decode() for k, v in fields.items()}}
                for entry_id, fields in entries]

    # Each event's stored fields (decoded independently), its seq, and the
    # chain's links computed from the stored elements.
    key = audit.keys.run_events(run_id)
    stored, previous = [], ""
    for seq, (fields, element) in enumerate(zip(run_fields(main_redis, key),
                                                run_list(main_redis, key)[1], strict=True), 1):
        link = hashlib.sha1(previous.encode() + element[16:]).hexdigest()
        stored.append({"id": str(seq), "seq": str(seq), "run_id": run_id,
                       **{k.decode(): v.decode() for k, v in fields.items()},
                       "prev": previous, "hash": link})
        previous = link
    assert stored[0]["note"] == "é" and stored[1]["task_id"] == "t-2"
    shown = invoke(app, "audit", "show", run_id, "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) == {"run_id": run_id, "events": stored}
    # The very text the command printed when events were plain dicts.
    assert shown.stdout == json.dumps({"run_id": run_id, "events": stored}, indent=2,
                                      sort_keys=True, ensure_ascii=False) + "\n"
    assert all(isinstance(value, str) for event in stored for value in event.values())

    # The tail: the lean copy, its time the entry id's.
    copies = decoded(main_redis.xrevrange(audit.keys.global_events, count=1))
    tail = invoke(app, "audit", "tail", "--count", "1", "--json")
    assert tail.exit_code == 0, tail.output
    assert tail.stdout.splitlines() == [json.dumps(
        {**copy, "ts": f"{int(copy['id'].split('-')[0]) / 1000:.3f}"}, sort_keys=True,
        ensure_ascii=False) for copy in copies]
    assert json.loads(tail.stdout)["status"] == "kept"
