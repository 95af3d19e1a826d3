"""Interruptions with real ``celery worker`` processes (prefork) and real SIGKILL.

A pool child killed mid-body, a hard time limit, and a whole worker killed mid-
body: a NON_IDEMPOTENT_WRITE whose body started ends as a dead letter
INTERRUPTED_WRITE and never runs again; the other effects run again.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters
from tests.conftest import Counter, WorkerProcess, on_broker, wait_for

pytestmark = pytest.mark.timeout(180)


def started_pids(client: redis.Redis, prefix: str, key: str) -> list[int]:
    return [int(pid) for pid in client.lrange(f"{prefix}started:{key}", 0, -1)]


def assert_one_key_and_rising_fences(events: list[dict[str, str]], attempts: int) -> None:
    """Every attempt's intent carries the task's one idempotency key and a
    fencing token above the one before it."""
    intents = [e for e in events if e["phase"] == "intent"]
    assert len(intents) == attempts
    assert len({e["idempotency_key"] for e in intents}) == 1
    assert [int(e["fencing_token"]) for e in intents] == list(range(1, attempts + 1))


def producer(make_app: Callable[..., Celery], prefix: str, broker_url: str,
             **transport: float) -> Celery:
    return make_app(**on_broker(prefix, broker_url, **transport))


def submit(app: Celery, name: str, key: str, hold: float) -> Any:
    return app.send_task(name, args=[key, hold], queue="tools")


@pytest.mark.parametrize(
    ("tool", "runs", "dead_letter_reason"),
    [
        ("tools.write", 1, "interrupted_write"),
        ("tools.idempotent", 2, None),
        ("tools.read", 2, None),
    ],
)
def test_pool_child_killed_mid_body(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, main_redis: redis.Redis, prefix: str, broker_url: str,
    tool: str, runs: int, dead_letter_reason: str | None,
) -> None:
    app = producer(make_app, prefix, broker_url)
    worker = spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result = submit(app, tool, key, hold=60)
    child = wait_for(lambda: started_pids(main_redis, prefix, key), what="the body to start")[0]
    assert child != worker.process.pid
    os.kill(child, signal.SIGKILL)

    if dead_letter_reason is None:
        assert result.get(timeout=60) == key
    else:
        letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                          what="the dead letter")
        assert letter.reason == dead_letter_reason
        assert letter.effect == "non_idempotent_write"
        wait_for(lambda: result.state == "FAILURE", what="FAILURE on the backend")
    assert counter.value(key) == runs, worker.output()[-3000:]
    events = AuditLog(app).events(result.id)
    assert "interrupted" in [e["phase"] for e in events]
    if tool != "tools.read":
        assert [e["phase"] for e in events].count("intent") == runs
        assert_one_key_and_rising_fences(events, runs)


@pytest.mark.parametrize(
    ("tool", "runs", "dead_letter_reason"),
    [("tools.write_limited", 1, "interrupted_write"), ("tools.read_limited", 2, None)],
)
def test_hard_time_limit(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, prefix: str, broker_url: str,
    tool: str, runs: int, dead_letter_reason: str | None,
) -> None:
    app = producer(make_app, prefix, broker_url)
    worker = spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result = submit(app, tool, key, hold=30)  # time_limit=1 kills the first run
    if dead_letter_reason is None:
        assert result.get(timeout=60) == key
    else:
        letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                          what="the dead letter")
        assert letter.reason == dead_letter_reason
        assert letter.exception_type == "TimeLimitExceeded"
    assert counter.value(key) == runs, worker.output()[-3000:]


@pytest.mark.parametrize(
    ("tool", "runs", "dead_letter_reason"),
    [("tools.write", 1, "interrupted_write"), ("tools.idempotent", 2, None)],
)
def test_whole_worker_killed_mid_body(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, main_redis: redis.Redis, prefix: str, broker_url: str,
    tool: str, runs: int, dead_letter_reason: str | None,
) -> None:
    visibility_timeout = 3.0
    app = producer(make_app, prefix, broker_url, visibility_timeout=visibility_timeout)
    first = spawn_worker(concurrency=1, visibility_timeout=visibility_timeout,
                         broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result = submit(app, tool, key, hold=60)
    wait_for(lambda: started_pids(main_redis, prefix, key), what="the body to start")
    first.kill()  # main process and pool child: nothing can settle the attempt
    assert counter.value(key) == 1

    # Redis: the message is still in the broker (unacked) and comes back once
    # its visibility timeout lapses; the journal's lease has lapsed by then
    # too. RabbitMQ: it comes back at once (the channel closed); the journal
    # lease (1.5 s, heartbeated) decides, after one deferral.
    second = spawn_worker(concurrency=1, visibility_timeout=visibility_timeout,
                          broker_url=broker_url)
    if dead_letter_reason is None:
        assert result.get(timeout=90) == key
    else:
        letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=90,
                          what="the dead letter after redelivery\n" + second.output()[-4000:])
        assert letter.reason == dead_letter_reason
    assert counter.value(key) == runs, second.output()[-3000:]
    events = AuditLog(app).events(result.id)
    assert "interrupted" in [e["phase"] for e in events]
    assert_one_key_and_rising_fences(events, runs)
