"""Approval before a write, with real workers: a call that needs a person's
approval is parked (nothing of it runs) until an operator decides.

``tools.approved_write`` (tests/apps/tool_app.py) needs approval for every
call, ``tools.refund`` for refunds above 100 only; the app's
``approval_requested`` receiver lists each parked call.
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
import redis
from celery import Celery

from celery_tooleffect import (
    ApprovalRejected,
    ApprovalRequired,
    Approvals,
    ApprovalState,
    AuditLog,
    DeadLetters,
    EffectRelabelRefused,
    ToolDeclarationError,
    ToolEffect,
    ToolTask,
)
from celery_tooleffect.testing import RedisServer
from tests.conftest import REDIS_URL, Counter, WorkerProcess, on_broker, wait_for

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def app(make_app: Callable[..., Celery], prefix: str, broker_url: str) -> Celery:
    return make_app(**on_broker(prefix, broker_url))


def parked(client: redis.Redis, prefix: str) -> list[str]:
    return [item.decode() for item in client.lrange(f"{prefix}parked", 0, -1)]


def errbacks(client: redis.Redis, prefix: str) -> list[str]:
    return [item.decode() for item in client.lrange(f"{prefix}errbacks", 0, -1)]


def approval_events(app: Celery, run_id: str) -> list[tuple[str, str]]:
    return [(e["phase"], e["status"]) for e in AuditLog(app).events(run_id)
            if e["phase"] in ("approval", "outcome", "intent")]


def wait_parked(app: Celery, task_id: str) -> Any:
    return wait_for(lambda: Approvals(app).get(task_id), timeout=60,
                    what=f"{task_id} to be parked")


def test_a_parked_call_runs_once_when_approved(
    app: Celery, spawn_worker: Callable[..., WorkerProcess], counter: Counter,
    main_redis: redis.Redis, prefix: str, broker_url: str,
) -> None:
    spawn_worker(concurrency=1, broker_url=broker_url)
    key = uuid.uuid4().hex[:8]
    result: Any = app.send_task("tools.approved_write", args=[key], queue="tools")
    approval = wait_parked(app, result.id)

    assert approval.state is ApprovalState.PENDING
    assert approval.name == "tools.approved_write" and approval.queue == "tools"
    assert approval.arguments == {"args_size": str(len(json.dumps([key]))), "kwargs_size": "2"}
    assert parked(main_redis, prefix) == [result.id]
    assert counter.value(key) == 0 and result.state == "PENDING"
    assert [a.task_id for a in Approvals(app).list()] == [result.id]

    decided = Approvals(app).approve(result.id, by="alice", reason="looks right")
    assert decided.ok, decided.message
    assert result.get(timeout=60) == key
    assert counter.value(key) == 1
    assert Approvals(app).get(result.id).state is ApprovalState.APPROVED
    assert Approvals(app).list() == []
    assert approval_events(app, result.id) == [
        ("approval", "requested"), ("approval", "approved"),
        ("intent", "started"), ("outcome", "succeeded"),
    ]
    [decision] = [e for e in AuditLog(app).events(result.id) if e["status"] == "approved"]
    assert decision["actor"] == "alice" and decision["reason"] == "looks right"
