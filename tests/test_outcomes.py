"""The rows of the "How a task ends" table (docs/guide.md) through a real in-process worker.

Each body counts its executions in Redis, so every test asserts how many times
the body really ran, where the message ended, and what the audit holds. Faults
are real: the audit store is a second redis-server made to refuse writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry
from celery.signals import before_task_publish

from celery_tooleffect import (
    AuditLog,
    AuditPersistenceFailed,
    DeadLettered,
    DeadLetters,
    NoSideEffect,
    ToolEffect,
    ToolTask,
)
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from tests.conftest import Counter, RedisServer, on_broker, running_worker, wait_for

READ, IDEM, WRITE = (
    ToolEffect.READ_ONLY,
    ToolEffect.IDEMPOTENT_WRITE,
    ToolEffect.NON_IDEMPOTENT_WRITE,
)
ALL_EFFECTS = [READ, IDEM, WRITE]
WRITES = [IDEM, WRITE]


class PermissionDenied(Exception):
    failure_class = "auth"


def define_tools(
    app: Celery, counter: Counter, store: RedisServer | None = None
) -> dict[ToolEffect, Any]:
    """One tool per effect; the ``behaviour`` argument picks what the body does."""

    def body(key: str, behaviour: str = "ok") -> str:
        runs = counter.hit(key)
        if behaviour == "connection":
            raise ConnectionError("provider unreachable")
        if behaviour == "unknown":
            raise ValueError("provider said something unexpected")
        if behaviour == "auth":
            raise PermissionDenied("token revoked")
        if behaviour == "no_side_effect":
            raise NoSideEffect(ConnectionError("refused before anything was sent"))
        if behaviour == "fail_first" and runs == 1:
            raise ConnectionError("provider unreachable once")
        if behaviour.startswith("break_store"):
            assert store is not None
            store.refuse_writes()
            if behaviour == "break_store_then_fail":
                raise ConnectionError("provider unreachable")
        return f"done:{key}"

    return {
        effect: app.task(
            base=ToolTask, effect=effect, name=f"tools.{effect.value}", shared=False
        )(body)
        for effect in ToolEffect
    }


def dead_letter(app: Celery, task_id: str) -> Any:
    return wait_for(lambda: DeadLetters(app).get(task_id), what=f"dead letter {task_id}")


def phases(app: Celery, run_id: str) -> list[str]:
    return [event["phase"] for event in AuditLog(app).events(run_id)]


@pytest.fixture
def tools(
    make_app: Callable[..., Celery], counter: Counter, prefix: str, broker_url: str,
) -> tuple[Celery, dict[ToolEffect, Any]]:
    """One tool per effect, on each broker in turn (RabbitMQ: a vhost of the test's own).

    The scenarios that break the store run on Redis only: on RabbitMQ the dead
    letters live in that same store (tests/test_rabbitmq.py covers that case).
    """
    app = make_app(**on_broker(prefix, broker_url))
    return app, define_tools(app, counter)


# -- body succeeds, outcome recorded: ack ---------------------------------------


@pytest.mark.parametrize("effect", ALL_EFFECTS)
def test_success_is_acknowledged_once_and_audited(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter, effect: ToolEffect
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool[effect].delay("k")
        assert result.get(timeout=20) == "done:k"
    assert counter.value("k") == 1
    events = AuditLog(app).events(result.id)
    if effect.is_write:
        assert [e["phase"] for e in events] == ["intent", "outcome"]
        assert events[1]["status"] == "succeeded"
    else:
        assert [e["phase"] for e in events] == ["outcome"]
    for event in events:
        assert event["run_id"] == result.id and event["effect"] == effect.value
        assert event["tool"] == f"tools.{effect.value}" and event["worker"]
    assert DeadLetters(app).get(result.id) is None


# -- body succeeds, outcome cannot be recorded -------------------------------------


@pytest.mark.parametrize("effect", WRITES)
def test_write_whose_outcome_cannot_be_stored_fails_closed(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
    effect: ToolEffect,
) -> None:
    app = make_app(tooleffect_redis_url=second_redis.url)
    tool = define_tools(app, counter, store=second_redis)
    with running_worker(app):
        result = tool[effect].delay("k", "break_store")
        letter = dead_letter(app, result.id)
        wait_for(lambda: result.state == "FAILURE", what="FAILURE on the backend")
    assert counter.value("k") == 1
    assert letter.reason == "not_retryable"
    assert letter.failure_class == "unknown"
    assert letter.exception_type == "AuditPersistenceFailed"
    assert letter.body_completed is True
    assert isinstance(result.result, DeadLettered)
    assert result.result.failure_class == "unknown"
    # The intent was stored before the store broke; the outcome never was.
    second_redis.accept_writes()
    assert phases(app, result.id) == ["intent"]


@pytest.mark.parametrize("effect", WRITES)
def test_write_whose_failed_outcome_cannot_be_stored_fails_closed(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
    effect: ToolEffect,
) -> None:
    app = make_app(tooleffect_redis_url=second_redis.url)
    tool = define_tools(app, counter, store=second_redis)
    with running_worker(app):
        result = tool[effect].delay("k", "break_store_then_fail")
        letter = dead_letter(app, result.id)
    assert counter.value("k") == 1  # a retryable error, but never retried
    assert letter.reason == "not_retryable"
    assert letter.failure_class == "unknown"
    assert letter.exception_type == "AuditPersistenceFailed"
    assert letter.body_completed is False


def test_read_only_audit_failure_is_fail_soft(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer
) -> None:
    app = make_app(tooleffect_redis_url=second_redis.url)
    tool = define_tools(app, counter, store=second_redis)
    with running_worker(app):
        result = tool[READ].delay("k", "break_store")
        assert result.get(timeout=20) == "done:k"
    assert counter.value("k") == 1
    assert DeadLetters(app).get(result.id) is None
    second_redis.accept_writes()
    assert AuditLog(app).events(result.id) == []


# -- lease or intent cannot be secured -------------------------------------------


@pytest.mark.parametrize("effect", WRITES)
def test_write_does_not_run_without_its_intent_and_is_retried(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
    effect: ToolEffect,
) -> None:
    app = make_app(
        tooleffect_redis_url=second_redis.url, tooleffect_max_retries=50,
        tooleffect_backoff_base=0.2, tooleffect_backoff_cap=0.2,
    )
    tool = define_tools(app, counter, store=second_redis)
    second_redis.refuse_writes()
    with running_worker(app):
        result = tool[effect].delay("k")
        wait_for(lambda: result.state == "RETRY", what="a retry while the store refuses writes")
        assert counter.value("k") == 0
        second_redis.accept_writes()
        assert result.get(timeout=20) == "done:k"
    assert counter.value("k") == 1
    assert phases(app, result.id) == ["intent", "outcome"]


@pytest.mark.parametrize("effect", WRITES)
def test_intent_refused_until_budget_spent_ends_as_dead_letter(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
    effect: ToolEffect,
) -> None:
    app = make_app(tooleffect_redis_url=second_redis.url)
    tool = define_tools(app, counter)
    second_redis.refuse_writes()
    with running_worker(app):
        result = tool[effect].delay("k")
        letter = dead_letter(app, result.id)
    assert counter.value("k") == 0
    assert letter.reason == "retries_exhausted"
    assert letter.failure_class == "connection"
    assert letter.exception_type == "IntentNotRecorded"


# -- body raises a retryable class ------------------------------------------------


@pytest.mark.parametrize("effect", [READ, IDEM])
def test_retryable_failure_is_retried_then_dead_lettered(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter, effect: ToolEffect
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool[effect].delay("k", "connection")
        letter = dead_letter(app, result.id)
    assert counter.value("k") == 3  # the first run and tooleffect_max_retries=2 retries
    assert letter.reason == "retries_exhausted"
    assert letter.failure_class == "connection"
    assert letter.exception_type == "ConnectionError"


@pytest.mark.parametrize("effect", [READ, IDEM])
def test_retryable_failure_then_success(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter, effect: ToolEffect
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool[effect].delay("k", "fail_first")
        assert result.get(timeout=20) == "done:k"
    assert counter.value("k") == 2
    if effect.is_write:
        assert phases(app, result.id) == ["intent", "outcome", "intent", "outcome"]
        statuses = [e["status"] for e in AuditLog(app).events(result.id)]
        assert statuses == ["started", "retrying", "started", "succeeded"]


def test_non_idempotent_write_is_not_retried_after_its_body_started(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool[WRITE].delay("k", "connection")
        letter = dead_letter(app, result.id)
    assert counter.value("k") == 1
    assert letter.reason == "not_retryable"
    assert letter.failure_class == "connection"
    assert phases(app, result.id) == ["intent", "outcome", "dead_lettered"]


def test_non_idempotent_write_marked_no_side_effect_is_retried(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool[WRITE].delay("k", "no_side_effect")
        letter = dead_letter(app, result.id)
    assert counter.value("k") == 3
    assert letter.reason == "retries_exhausted"
    assert letter.failure_class == "connection"


# -- body raises a non-retryable class ---------------------------------------------


@pytest.mark.parametrize("effect", ALL_EFFECTS)
@pytest.mark.parametrize(("behaviour", "failure_class"), [("unknown", "unknown"), ("auth", "auth")])
def test_non_retryable_failure_is_dead_lettered_at_once(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter, effect: ToolEffect,
    behaviour: str, failure_class: str,
) -> None:
    app, tool = tools
    with running_worker(app):
        result = tool[effect].delay("k", behaviour)
        letter = dead_letter(app, result.id)
        wait_for(lambda: result.state == "FAILURE", what="FAILURE on the backend")
    assert counter.value("k") == 1
    assert letter.reason == "not_retryable"
    assert letter.failure_class == failure_class
    assert letter.effect == effect.value
    assert letter.args == ["k", behaviour]
    # The backend holds what the body raised, as plain Celery stores it (its
    # traceback included); the dead letter says why and which class.
    expected = {"unknown": ValueError, "auth": PermissionDenied}[behaviour]
    assert type(result.result) is expected, repr(result.result)
    assert result.result.args == {"unknown": ("provider said something unexpected",),
                                  "auth": ("token revoked",)}[behaviour]
    assert f"in body\n    raise {expected.__name__}(" in result.traceback, result.traceback
    with pytest.raises(expected):
        result.get(timeout=5)


# -- delivered again after it succeeded or was dead-lettered ------------------------


@pytest.mark.parametrize("effect", WRITES)
def test_write_delivered_again_after_success_is_acknowledged_without_running(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter, effect: ToolEffect
) -> None:
    app, tool = tools
    with running_worker(app):
        first = tool[effect].delay("k")
        assert first.get(timeout=20) == "done:k"
        tool[effect].apply_async(("k",), task_id=first.id)
        wait_for(lambda: "duplicate_ignored" in phases(app, first.id), what="duplicate ignored")
    assert counter.value("k") == 1
    assert first.state == "SUCCESS"
    assert phases(app, first.id) == ["intent", "outcome", "duplicate_ignored"]


@pytest.mark.parametrize("effect", WRITES)
def test_write_delivered_again_after_dead_letter_is_acknowledged_without_running(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter, effect: ToolEffect
) -> None:
    app, tool = tools
    with running_worker(app):
        first = tool[effect].delay("k", "unknown")
        dead_letter(app, first.id)
        tool[effect].apply_async(("k", "unknown"), task_id=first.id)
        wait_for(lambda: "duplicate_ignored" in phases(app, first.id), what="duplicate ignored")
    assert counter.value("k") == 1


def test_read_only_delivered_again_runs_again(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter
) -> None:
    app, tool = tools
    with running_worker(app):
        first = tool[READ].delay("k")
        assert first.get(timeout=20) == "done:k"
        tool[READ].apply_async(("k",), task_id=first.id)
        wait_for(lambda: counter.value("k") == 2, what="the second run")
    assert phases(app, first.id) == ["outcome", "outcome"]


# -- interactive runs ---------------------------------------------------------------


@pytest.mark.parametrize("effect", WRITES)
@pytest.mark.parametrize("how", ["apply", "eager", "direct"])
def test_interactive_write_whose_outcome_cannot_be_stored_raises(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
    effect: ToolEffect, how: str,
) -> None:
    app = make_app(tooleffect_redis_url=second_redis.url, task_always_eager=how == "eager")
    tool = define_tools(app, counter, store=second_redis)[effect]
    if how == "apply":
        result = tool.apply(("k", "break_store"))
        assert result.state == "FAILURE"
        assert isinstance(result.result, AuditPersistenceFailed)
    elif how == "eager":
        result = tool.delay("k", "break_store")
        assert result.state == "FAILURE"
        with pytest.raises(AuditPersistenceFailed):
            result.get()
    else:
        with pytest.raises(AuditPersistenceFailed):
            tool("k", "break_store")
    assert counter.value("k") == 1
    second_redis.accept_writes()
    assert DeadLetters(app).list() == []


@pytest.mark.parametrize("effect", WRITES)
def test_interactive_write_is_journalled_like_a_queued_one(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter, effect: ToolEffect
) -> None:
    app, tool = tools
    result = tool[effect].apply(("k",))
    assert result.get() == "done:k"
    assert phases(app, result.id) == ["intent", "outcome"]
    failed = tool[effect].apply(("f", "connection"))
    assert failed.state == "FAILURE" and isinstance(failed.result, ConnectionError)
    assert counter.value("f") == 1  # interactive runs are never retried
    assert [e["status"] for e in AuditLog(app).events(failed.id)] == ["started", "failed"]
    assert AuditLog(app).events(failed.id)[1]["failure_class"] == "connection"


def test_run_id_header_groups_the_calls_of_one_run(
    tools: tuple[Celery, dict[ToolEffect, Any]], counter: Counter
) -> None:
    app, tool = tools
    with running_worker(app):
        one = tool[WRITE].apply_async(("a",), headers={"tooleffect_run_id": "run-{42}"})
        two = tool[READ].apply_async(("b",), headers={"tooleffect_run_id": "run-{42}"})
        one.get(timeout=20)
        two.get(timeout=20)
    events = AuditLog(app).events("run-{42}")
    assert {e["task_id"] for e in events} == {one.id, two.id}
    assert [e["seq"] for e in events] == ["1", "2", "3"]


@pytest.mark.parametrize("new_args", [False, True], ids=["same_args", "new_args"])
@pytest.mark.parametrize("effect", WRITES)
def test_a_writes_own_retry_is_sent_once_its_attempt_has_ended(
    make_app: Callable[..., Celery], counter: Counter, effect: ToolEffect, new_args: bool
) -> None:
    """Celery's ``Task.retry`` sends the retry before the attempt's outcome is
    recorded; sent so, a retry with no countdown could begin while its own
    attempt is still 'running' (deferred for the attempt's lease, or refused as
    a conflict when it asked for other arguments). The retry is held until the
    journal has left 'running': what the journal says when it is published."""
    app = make_app()
    seen: list[dict[str, str]] = []

    @app.task(base=ToolTask, effect=effect, name="tools.polls_now", shared=False, bind=True)
    def polls(self: ToolTask, key: str) -> str:
        if counter.hit("calls") == 1:
            raise self.retry(args=(f"{key}-again",) if new_args else None, countdown=0)
        return key

    def at_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("task") == "tools.polls_now" and headers.get("retries"):
            task_id = str(headers["id"])
            seen.append(runtime_for(app).journal.read(JournalRef(task_id, task_id)))

    before_task_publish.connect(at_publish, weak=False)
    try:
        with running_worker(app):
            result = polls.delay("k")
            assert result.get(timeout=20) == ("k-again" if new_args else "k")
    finally:
        before_task_publish.disconnect(at_publish)
    assert counter.value("calls") == 2
    assert [entry["state"] for entry in seen] == ["retry_scheduled"]
    statuses = [e["status"] for e in AuditLog(app).events(result.id)]
    assert statuses == ["started", "retrying", "started", "succeeded"]


@pytest.mark.parametrize("how", ["caught", "throw_false"])
def test_a_retry_the_body_goes_on_after_is_sent_once_it_ended(
    make_app: Callable[..., Celery], counter: Counter, how: str,
) -> None:
    """A body that goes on after ``self.retry()`` (``throw=False``, or Celery's
    ``Retry`` caught): its retry is sent all the same, once the attempt's
    outcome is recorded, and, finding the call succeeded, runs nothing."""
    app = make_app()
    published: list[int] = []

    @app.task(base=ToolTask, effect=WRITE, name="tools.catches_retry", shared=False, bind=True)
    def catches(self: ToolTask, key: str) -> str:
        counter.hit(key)
        if how == "throw_false":
            self.retry(countdown=0, throw=False)
        else:
            with contextlib.suppress(Retry):
                self.retry(countdown=0)
        return key

    def at_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("task") == "tools.catches_retry":
            published.append(int(headers.get("retries") or 0))

    before_task_publish.connect(at_publish, weak=False)
    try:
        with running_worker(app):
            result = catches.delay("k")
            assert result.get(timeout=20) == "k"
            wait_for(lambda: "duplicate_ignored" in phases(app, result.id), timeout=20,
                     what="the retry's delivery to find the call succeeded")
    finally:
        before_task_publish.disconnect(at_publish)
    assert published == [0, 1]
    assert counter.value("k") == 1
    assert phases(app, result.id) == ["intent", "outcome", "duplicate_ignored"]


@pytest.mark.parametrize("effect", ALL_EFFECTS)
def test_a_tool_may_ask_for_its_own_retry(
    make_app: Callable[..., Celery], counter: Counter, effect: ToolEffect
) -> None:
    app = make_app()

    @app.task(base=ToolTask, effect=effect, name="tools.polls", shared=False, bind=True)
    def polls(self: ToolTask, key: str) -> str:
        if counter.hit(key) == 1:
            raise self.retry(countdown=0.05)
        return key

    with running_worker(app):
        result = polls.delay("k")
        assert result.get(timeout=20) == "k"
    assert counter.value("k") == 2
    if effect.is_write:
        statuses = [e["status"] for e in AuditLog(app).events(result.id)]
        assert statuses == ["started", "retrying", "started", "succeeded"]
