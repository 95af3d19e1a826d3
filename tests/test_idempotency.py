"""``self.idempotency_key`` and ``self.fencing_token`` as a tool's body sees them.

The key is the task's: the same across retries and replays (and redeliveries:
tests/test_interruptions.py), different for another task. The fencing token
comes from the journal with each attempt's intent and only ever rises. Real
in-process workers on Redis; each body records what it saw.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import (
    AuditLog,
    DeadLetters,
    ToolContextError,
    ToolEffect,
    ToolTask,
)
from celery_tooleffect.admin.operations import DeadLetterOperations, Outcome
from celery_tooleffect.store.journal import Journal, JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.worker.attempt import Attempt
from tests.conftest import running_worker, wait_for


class Declined(Exception):
    failure_class = "client_error"


def define_tools(app: Celery, client: redis.Redis, prefix: str) -> dict[str, Any]:
    def seen(self: ToolTask, key: str) -> int:
        fence = self.fencing_token if self.tool_effect.is_write else -1
        return int(client.rpush(f"{prefix}seen:{key}", json.dumps([self.idempotency_key, fence])))

    @app.task(base=ToolTask, bind=True, name="ids.flaky", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def flaky(self: ToolTask, key: str, fails: int) -> str:
        if seen(self, key) <= fails:
            raise ConnectionError("the provider dropped the connection")
        return self.idempotency_key

    @app.task(base=ToolTask, bind=True, name="ids.charge", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def charge(self: ToolTask, key: str) -> str:
        if seen(self, key) == 1:
            raise Declined("declined the first time")
        return self.idempotency_key

    @app.task(base=ToolTask, bind=True, name="ids.read", shared=False)
    def read(self: ToolTask, key: str) -> str:
        seen(self, key)
        try:
            _ = self.fencing_token
        except ToolContextError:
            return self.idempotency_key
        raise AssertionError("a READ_ONLY tool has no fencing token")

    return {"flaky": flaky, "charge": charge, "read": read}


@pytest.fixture
def tools(make_app: Callable[..., Celery], main_redis: redis.Redis,
          prefix: str) -> tuple[Celery, dict[str, Any]]:
    app = make_app(tooleffect_backoff_base=0.1, tooleffect_backoff_cap=0.2)
    return app, define_tools(app, main_redis, prefix)


def seen(client: redis.Redis, prefix: str, key: str) -> list[tuple[str, int]]:
    return [tuple(json.loads(raw)) for raw in client.lrange(f"{prefix}seen:{key}", 0, -1)]


def intents(app: Celery, run_id: str) -> list[dict[str, str]]:
    return [e for e in AuditLog(app).events(run_id) if e["phase"] == "intent"]


def test_retries_keep_the_key_and_raise_the_fencing_token(
    tools: tuple[Celery, dict[str, Any]], main_redis: redis.Redis, prefix: str,
) -> None:
    app, tool = tools
    with running_worker(app):
        first = tool["flaky"].delay("a", 2)
        other = tool["flaky"].delay("b", 0)
        key = first.get(timeout=30)
        other_key = other.get(timeout=30)
    assert seen(main_redis, prefix, "a") == [(key, 1), (key, 2), (key, 3)]
    assert seen(main_redis, prefix, "b") == [(other_key, 1)]
    assert key != other_key and len(key) == 32
    recorded = intents(app, first.id)
    assert [(e["idempotency_key"], int(e["fencing_token"])) for e in recorded] == [
        (key, 1), (key, 2), (key, 3)]


def test_a_replay_keeps_the_key_and_raises_the_fencing_token(
    tools: tuple[Celery, dict[str, Any]], main_redis: redis.Redis, prefix: str,
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool["charge"].delay("c")
        wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
        replayed = DeadLetterOperations(app).replay(
            result.id, actor="test", reason="declined by mistake", force=True)
        assert replayed.outcome is Outcome.DONE, replayed.message
        wait_for(lambda: len(seen(main_redis, prefix, "c")) == 2, what="the replayed run")
        wait_for(lambda: result.state == "SUCCESS", what="SUCCESS after the replay")
    (key, fence), (key_again, fence_again) = seen(main_redis, prefix, "c")
    assert key == key_again == result.get(timeout=5)
    assert fence_again > fence
    assert [int(e["fencing_token"]) for e in intents(app, result.id)] == [fence, fence_again]


def test_a_read_has_a_key_and_no_fencing_token(
    tools: tuple[Celery, dict[str, Any]], main_redis: redis.Redis, prefix: str,
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool["read"].delay("r")
        key = result.get(timeout=30)
    assert seen(main_redis, prefix, "r") == [(key, -1)]
    with pytest.raises(ToolContextError, match="only while the tool runs"):
        _ = tool["read"].idempotency_key


def test_the_key_is_the_run_and_the_task() -> None:
    def key(run_id: str, task_id: str) -> str:
        return Attempt(task_id=task_id, run_id=run_id, name="t", effect=ToolEffect.READ_ONLY,
                       queue="q", token="", redelivered=False, interactive=False,
                       retries=0).idempotency_key

    assert key("run-1", "task-1") == key("run-1", "task-1")
    assert len({key("run-1", "task-1"), key("run-2", "task-1"), key("run-1", "task-2")}) == 3


def test_the_fence_rises_with_each_attempt_and_not_with_a_resent_begin(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    runtime = runtime_for(app)
    journal: Journal = runtime.journal
    ref = JournalRef("fence-run", "fence-task")
    context = Attempt(task_id=ref.task_id, run_id=ref.run_id, name="t",
                      effect=ToolEffect.IDEMPOTENT_WRITE, queue="q", token="", redelivered=False,
                      interactive=False, retries=0).context

    def begin(token: str, lease_end: float) -> Any:
        return journal.begin_attempt(ref, token=token, effect="idempotent_write",
                                     lease_end=lease_end, attempts_allowed=5,
                                     event=context.event("intent", "started"))

    first = begin("a", lease_end=0.0)         # a lease that has lapsed already
    resent = begin("a", lease_end=0.0)        # the same owner's begin, sent again
    reclaimed = begin("b", lease_end=2e9)     # another delivery reclaims it
    assert (first.fencing_token, resent.fencing_token, reclaimed.fencing_token) == (1, 1, 2)
    assert journal.read(ref)["fence"] == "2"


def test_reconcile_is_declared_by_option_decorator_or_method(
    make_app: Callable[..., Celery],
) -> None:
    from celery_tooleffect import Reconciliation, ToolDeclarationError
    from celery_tooleffect.actions.reconciling import reconciler_of

    app = make_app()

    def found(self: ToolTask, key: str) -> Reconciliation:
        return Reconciliation.applied(f"{self.name}:{key}", evidence="found")

    def body(key: str) -> str:
        return key

    write = ToolEffect.NON_IDEMPOTENT_WRITE
    by_option = app.task(base=ToolTask, name="ids.by_option", shared=False, effect=write,
                         reconcile=found)(body)
    by_decorator = app.task(base=ToolTask, name="ids.by_decorator", shared=False,
                            effect=write)(body)
    by_decorator.reconciler(found)

    class ByMethod(ToolTask):
        effect = ToolEffect.NON_IDEMPOTENT_WRITE

        def reconcile(self, key: str) -> Reconciliation:  # type: ignore[override]
            return found(self, key)

    by_method = app.task(base=ByMethod, name="ids.by_method", shared=False)(body)
    for tool in (by_option, by_decorator, by_method):
        check = reconciler_of(tool)
        assert check is not None
        assert check("k") == Reconciliation.applied(f"{tool.name}:k", evidence="found")
    with pytest.raises(ToolDeclarationError, match="already"):
        by_decorator.reconciler(found)
    read = app.task(base=ToolTask, name="ids.read_only", shared=False)(body)
    assert reconciler_of(read) is None
    with pytest.raises(ToolDeclarationError, match="nothing to reconcile"):
        read.reconciler(found)
