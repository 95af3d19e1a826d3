"""A result the app's result serializer cannot encode ends the call once (issue 38).

A tool returning a ``set`` under JSON (or an object pickle refuses) used to
fail outside its body: Celery raised ``EncodeError`` from ``mark_as_done``
after the body returned, and the worker's main process took that for an
interruption (a read or an idempotent write ran again until its budget was
spent; a non-idempotent write became an ``interrupted_write`` letter saying
its body had not completed). Now the pool process tries the encoding before
it records anything: the call is a dead letter ``not_retryable``, class
``unknown``, whose letter says a write's body completed; Celery's result is the
``ResultNotStorable`` (an ``EncodeError``) naming the type; a write's journal
says ``dead_lettered`` with ``body_completed``, never interrupted.

Real ``celery worker`` subprocesses (prefork pool: the failure crosses back to
the main process as a pickled ``ExceptionInfo``) on the test's Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from kombu.exceptions import EncodeError

from celery_tooleffect import AuditLog, DeadLetters, ResultNotStorable, ToolEffect
from celery_tooleffect.admin.operations.rules import replay_refusal
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import RedisServer, WorkerProcess, start_celery_worker, wait_for
from celery_tooleffect.worker.results import backend_is_the_store
from tests.apps.unstorable_app import build
from tests.conftest import REDIS_URL, TESTS, dead_lettering_ended

pytestmark = pytest.mark.timeout(120)

Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def workers(prefix: str, tmp_path: Path) -> Iterator[Spawn]:
    """``celery -A tests.apps.unstorable_app worker`` subprocesses, killed at the end."""
    started: list[WorkerProcess] = []

    def spawn(**env: str) -> WorkerProcess:
        worker = start_celery_worker(
            "tests.apps.unstorable_app", tmp_path / f"worker-{len(started)}.log",
            concurrency=2, name="unstorable", root=TESTS.parent,
            env={"TE_PREFIX": prefix, "TE_BROKER": REDIS_URL, **env})
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.kill()


def runs(main_redis: redis.Redis, prefix: str, key: str) -> int:
    return int(main_redis.get(f"{prefix}count:{key}") or 0)


def ends_once(app: Celery, effect: ToolEffect, kind: str, *, main_redis: redis.Redis,
              prefix: str, type_name: str) -> None:
    """Call ``unstorable.<effect>`` and check every record of how it ended."""
    key = f"{effect.value}-{kind}"
    result = app.tasks[f"unstorable.{effect.value}"].delay(key, kind)
    letters = DeadLetters(app)
    wait_for(lambda: letters.get(result.id) is not None, timeout=60, what="the dead letter")
    dead_lettering_ended(app, result.id)

    # The body ran once, and nothing runs it again.
    assert runs(main_redis, prefix, key) == 1
    # Celery's result: FAILURE, the package's EncodeError naming the type and kombu's error.
    assert result.state == "FAILURE"
    failure = result.result
    assert isinstance(failure, ResultNotStorable) and isinstance(failure, EncodeError)
    assert f"cannot encode a {type_name}: EncodeError: " in str(failure)
    with pytest.raises(EncodeError):
        result.get(timeout=5)
    # The dead letter: not retryable, class unknown; a write's says its body completed.
    letter = letters.get(result.id)
    assert letter is not None
    assert (letter.reason, letter.failure_class, letter.exception_type, letter.body_completed,
            letter.attempts) == ("not_retryable", "unknown", "ResultNotStorable",
                                 effect.is_write, 1)
    assert f"a {type_name}: EncodeError: " in letter.error
    events = [(event["phase"], event["status"]) for event in AuditLog(app).events(result.id)]
    assert ("outcome", "result_not_stored") in events
    assert not any(phase == "interrupted" for phase, _ in events), events
    refusal = replay_refusal(letter, force=False, reason="", bulk=False)
    if effect.is_write:
        # A plain replay would write again: refused, saying why.
        assert refusal is not None and refusal.startswith("the write already ran:")
        assert "its result could not be stored (ResultNotStorable)" in refusal
        # The journal says the write ran and ended: settled, never interrupted.
        entry = runtime_for(app).journal.read(JournalRef(result.id, result.id))
        assert (entry.get("state"), entry.get("body_completed"),
                entry.get("exception_type")) == ("dead_lettered", "1", "ResultNotStorable")
        assert events[0] == ("intent", "started")
    else:
        assert refusal is None  # a read replays (once the tool is fixed, it answers)


@pytest.mark.parametrize("effect", list(ToolEffect), ids=lambda effect: effect.value)
def test_a_set_under_json_ends_the_call_once(
    workers: Spawn, prefix: str, main_redis: redis.Redis, effect: ToolEffect,
) -> None:
    """The result backend is the store's Redis: the outcome's script would store it."""
    app = build(prefix)
    assert backend_is_the_store(app.backend, runtime_for(app))
    workers()
    ends_once(app, effect, "set", main_redis=main_redis, prefix=prefix, type_name="set")


@pytest.mark.parametrize("effect", [ToolEffect.READ_ONLY, ToolEffect.NON_IDEMPOTENT_WRITE],
                         ids=lambda effect: effect.value)
def test_a_set_ends_the_call_once_when_celery_stores_the_result(
    workers: Spawn, prefix: str, main_redis: redis.Redis, second_redis: RedisServer,
    effect: ToolEffect,
) -> None:
    """The result backend is another Redis: Celery's tracer would store it, after
    the outcome was recorded; the encoding is tried before."""
    app = build(prefix, result_backend=second_redis.url)
    assert not backend_is_the_store(app.backend, runtime_for(app))
    workers(TE_RESULTS=second_redis.url)
    ends_once(app, effect, "set", main_redis=main_redis, prefix=prefix, type_name="set")


def test_an_object_pickle_refuses_ends_the_call_once(
    workers: Spawn, prefix: str, main_redis: redis.Redis,
) -> None:
    app = build(prefix, serializer="pickle")
    workers(TE_SERIALIZER="pickle")
    ends_once(app, ToolEffect.IDEMPOTENT_WRITE, "lock", main_redis=main_redis, prefix=prefix,
              type_name="_thread.lock")
