"""Reconciliation of interrupted NON_IDEMPOTENT_WRITEs, with real workers and SIGKILL.

``tools.charge`` (tests/apps/tool_app.py) charges a provider stand-in that
deduplicates by the task's idempotency key, and declares ``reconcile``, which
asks that provider. Its pool child (or whole worker) is killed in the body:
the next delivery asks the tool instead of dead-lettering the write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters
from tests.conftest import REDIS_URL, Counter, WorkerProcess, on_broker, wait_for

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent


def started_pids(client: redis.Redis, prefix: str, key: str) -> list[int]:
    return [int(pid) for pid in client.lrange(f"{prefix}started:{key}", 0, -1)]


def charges(client: redis.Redis, prefix: str, key: str) -> int:
    return int(client.get(f"{prefix}charges:{key}") or 0)


def reconcile_events(app: Celery, run_id: str) -> list[dict[str, str]]:
    return [e for e in AuditLog(app).events(run_id) if e["phase"] == "reconcile"]


def body_running(main_redis: redis.Redis, prefix: str, key: str, *, charged: bool) -> int:
    """The pid of the pool child running ``tools.charge``'s body once it started
    and, with ``charged`` (``when="after"``), once it made the charge: the body
    pushes its pid a moment before it charges, and a kill in that moment (a
    busy machine, e.g. tests side by side under pytest-xdist) would leave the
    write not made."""
    child = wait_for(lambda: started_pids(main_redis, prefix, key), what="the body to start")[0]
    if charged:
        wait_for(lambda: charges(main_redis, prefix, key) == 1, what="the charge")
    return child


def kill_child_mid_body(main_redis: redis.Redis, prefix: str, key: str,
                        worker: WorkerProcess, *, charged: bool) -> None:
    child = body_running(main_redis, prefix, key, charged=charged)
    assert child != worker.process.pid
    os.kill(child, signal.SIGKILL)


@pytest.fixture
def app(make_app: Callable[..., Celery], prefix: str, broker_url: str) -> Celery:
    return make_app(**on_broker(prefix, broker_url))


def test_a_write_that_happened_is_settled_applied_and_its_chain_goes_on(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    worker = spawn_worker(concurrency=1, broker_url=broker_url)
    key, after = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    workflow = (app.signature("tools.charge", args=[key, 60, "after"], queue="tools")
                | app.signature("tools.read", args=[after], immutable=True, queue="tools"))
    result = workflow.apply_async()
    charged = result.parent
    kill_child_mid_body(main_redis, prefix, key, worker, charged=True)

    assert charged.get(timeout=60) == f"ch-{key}-1"
    assert result.get(timeout=60) == after  # the chain went on
    assert counter.value(key) == 1  # the body ran once
    assert charges(main_redis, prefix, key) == 1
    assert counter.value(after) == 1
    [event] = reconcile_events(app, charged.id)
    assert event["status"] == "applied" and "evidence_size" in event
    outcome = [e for e in AuditLog(app).events(charged.id)  # the chain's run
               if e["phase"] == "outcome" and e["task_id"] == charged.id]
    assert [(e["status"], e.get("reconciled")) for e in outcome] == [("succeeded", "1")]
    assert DeadLetters(app).get(charged.id) is None


def test_a_write_that_did_not_happen_runs_again_once(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    worker = spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result = app.send_task("tools.charge", args=[key, 60, "before"], queue="tools")
    kill_child_mid_body(main_redis, prefix, key, worker, charged=False)

    assert result.get(timeout=60) == f"ch-{key}-2"
    assert counter.value(key) == 2  # killed before charging, then run again
    assert charges(main_redis, prefix, key) == 1  # one charge in the end
    assert [e["status"] for e in reconcile_events(app, result.id)] == ["not_applied"]
    intents = [e for e in AuditLog(app).events(result.id) if e["phase"] == "intent"]
    assert [e.get("reclaimed") for e in intents] == ["new", "reconciled"]
    assert [int(e["fencing_token"]) for e in intents] == [1, 2]


@pytest.mark.parametrize(
    ("answer", "status", "why"),
    [
        ("unknown", "unknown", "answered unknown"),
        ("raise", "failed", "LookupError"),
        ("slow", "failed", "did not answer within 2s"),
        ("nonsense", "failed", "not a Reconciliation"),
    ],
)
def test_a_write_nobody_can_tell_about_stays_a_dead_letter(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str, answer: str, status: str,
    why: str,
) -> None:
    worker = spawn_worker(concurrency=1, broker_url=broker_url, TE_RECONCILE_TIMEOUT="2")
    key = uuid.uuid4().hex[:8]
    result = app.send_task("tools.charge", args=[key, 60, "after", answer], queue="tools")
    kill_child_mid_body(main_redis, prefix, key, worker, charged=True)

    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                      what="the dead letter\n" + worker.output()[-3000:])
    main_redis.set(f"{prefix}release:{key}", "1")  # a slow reconcile may end now
    assert letter.reason == "interrupted_write"
    assert why in letter.error
    wait_for(lambda: result.state == "FAILURE", what="FAILURE on the backend")
    assert counter.value(key) == 1  # never run twice without knowing
    assert [e["status"] for e in reconcile_events(app, result.id)] == [status]


def test_a_redelivery_after_the_whole_worker_died_is_reconciled(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    visibility_timeout = 3.0
    app = make_app(**on_broker(prefix, broker_url, visibility_timeout=visibility_timeout))
    first = spawn_worker(concurrency=1, visibility_timeout=visibility_timeout,
                         broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result: Any = app.send_task("tools.charge", args=[key, 60, "after"], queue="tools")
    body_running(main_redis, prefix, key, charged=True)
    first.kill()  # nothing can settle the attempt: the journal lease lapses

    second = spawn_worker(concurrency=1, visibility_timeout=visibility_timeout,
                          broker_url=broker_url)
    assert result.get(timeout=90) == f"ch-{key}-1", second.output()[-3000:]
    assert counter.value(key) == 1
    assert charges(main_redis, prefix, key) == 1
    assert [e["status"] for e in reconcile_events(app, result.id)] == ["applied"]


# -- by an operator: celery-tooleffect dlq reconcile ---------------------------------


def operator_reconcile(prefix: str, broker_url: str, *arguments: str) -> dict[str, Any]:
    """``celery-tooleffect -A tests.apps.tool_app dlq reconcile ... --json``, as an
    operator runs it: the tool app (its tools, their reconcile) is imported."""
    env = dict(os.environ, TE_PREFIX=prefix, TE_BROKER=broker_url, TE_COUNTERS=REDIS_URL,
               TE_VT="60", TE_STORE="")
    done = subprocess.run(
        [sys.executable, "-m", "celery_tooleffect.admin.cli", "-A", "tests.apps.tool_app",
         "dlq", "reconcile", *arguments, "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.stdout, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    report["exit_code"] = done.returncode
    return report


def dead_lettered_charge(
    app: Celery, worker: WorkerProcess, main_redis: redis.Redis, prefix: str, when: str,
) -> tuple[str, Any]:
    """A charge killed mid-body whose reconcile first answers unknown: a dead letter."""
    key = uuid.uuid4().hex[:8]
    result = app.send_task("tools.charge", args=[key, 60, when, "unknown_once"], queue="tools")
    kill_child_mid_body(main_redis, prefix, key, worker, charged=when == "after")
    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                      what="the dead letter\n" + worker.output()[-3000:])
    assert letter.reason == "interrupted_write"
    return key, result


def test_an_operator_settles_a_letter_whose_write_happened(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    worker = spawn_worker(concurrency=1, broker_url=broker_url)
    key, result = dead_lettered_charge(app, worker, main_redis, prefix, "after")

    report = operator_reconcile(prefix, broker_url, result.id)
    [done] = report["results"]
    assert (done["outcome"], report["exit_code"]) == ("done", 0), report
    assert "applied" in done["message"]
    assert DeadLetters(app).get(result.id) is None
    assert app.AsyncResult(result.id).get(timeout=10) == f"ch-{key}-1"
    assert counter.value(key) == 1 and charges(main_redis, prefix, key) == 1
    events = reconcile_events(app, result.id)
    assert [(e["status"], e.get("via", "worker")) for e in events] == [
        ("unknown", "worker"), ("applied", "cli")]


def test_an_operator_replays_a_letter_whose_write_did_not_happen(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    worker = spawn_worker(concurrency=1, broker_url=broker_url)
    key, result = dead_lettered_charge(app, worker, main_redis, prefix, "before")

    report = operator_reconcile(prefix, broker_url, result.id)
    [done] = report["results"]
    assert done["outcome"] == "done" and "not_applied" in done["message"], report
    wait_for(lambda: counter.value(key) == 2, timeout=60, what="the replayed run")
    wait_for(lambda: app.AsyncResult(result.id).state == "SUCCESS", timeout=60,
             what="SUCCESS after the replay")
    assert app.AsyncResult(result.id).result == f"ch-{key}-2"
    assert charges(main_redis, prefix, key) == 1


def test_an_operator_cannot_reconcile_a_tool_that_cannot_tell(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], main_redis: redis.Redis,
    prefix: str, broker_url: str,
) -> None:
    worker = spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result = app.send_task("tools.write", args=[key, 60], queue="tools")
    kill_child_mid_body(main_redis, prefix, key, worker, charged=False)
    wait_for(lambda: DeadLetters(app).get(result.id), timeout=60, what="the dead letter")

    report = operator_reconcile(prefix, broker_url, result.id, "no-such-task")
    outcomes = [(r["task_id"], r["outcome"]) for r in report["results"]]
    assert outcomes == [(result.id, "refused"), ("no-such-task", "not_found")]
    assert report["exit_code"] != 0
    assert "declares no reconcile" in report["results"][0]["message"]
    assert DeadLetters(app).get(result.id) is not None
