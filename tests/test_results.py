"""Celery's result stored by a write's own outcome script (a read's: its audit
append), when the result backend is the store's Redis (worker/results.py):
everything that reads results behaves as with Celery's backend, and Celery
does not store it again."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group

from celery_tooleffect import ToolEffect, ToolTask
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.worker.results import backend_is_the_store
from tests.conftest import REDIS_URL, Counter, running_worker
from tests.support import Monitor

pytestmark = pytest.mark.timeout(120)


def tools(app: Celery, counter: Counter) -> dict[str, Any]:
    @app.task(base=ToolTask, name="results.write", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def write(key: str) -> dict[str, Any]:
        counter.hit(key)
        return {"key": key, "n": [1, 2]}

    @app.task(base=ToolTask, name="results.read", shared=False)
    def read(key: str) -> dict[str, Any]:
        counter.hit(key)
        return {"key": key, "n": [1, 2]}

    @app.task(base=ToolTask, name="results.double", shared=False)
    def double(x: int) -> int:
        return 2 * x

    @app.task(base=ToolTask, name="results.add", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(base=ToolTask, name="results.total", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def total(values: list[int]) -> int:
        return sum(values)

    @app.task(base=ToolTask, name="results.quiet", shared=False, ignore_result=True,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def quiet(key: str) -> str:
        counter.hit(key)
        return key

    return {"write": write, "read": read, "double": double, "add": add, "total": total,
            "quiet": quiet}


def commands_touching(monitor: Monitor, key: str) -> list[tuple[str, str]]:
    """The commands that touched ``key`` (scripts' own included), as (client
    type, command name)."""
    return [(c["client_type"], c["command"].split(" ", 1)[0]) for c in monitor.received
            if key in c["command"] and not c["command"].startswith(("EVAL", "MONITOR"))]


@pytest.mark.parametrize("name", ["write", "read"])
def test_the_outcome_stores_the_result_once_as_celery_would(
    make_app: Callable[..., Celery], counter: Counter, name: str,
) -> None:
    app = make_app(result_extended=True, result_expires=600)
    tool = tools(app, counter)
    assert backend_is_the_store(app.backend, runtime_for(app))
    key = uuid.uuid4().hex[:8]
    with running_worker(app), Monitor(redis.Redis.from_url(REDIS_URL)) as monitor:
        result = tool[name].delay(key)
        assert result.get(timeout=30) == {"key": key, "n": [1, 2]}  # pub/sub wait
    assert result.state == "SUCCESS" and counter.value(key) == 1
    assert result.name == f"results.{name}" and result.args == [key]  # result_extended
    assert result.date_done is not None
    result_key = app.backend.get_key_for_task(result.id).decode()
    # Stored by the outcome's script or the read's audit append (client_type
    # lua), once; Celery's tracer
    # did not store it again (its SETEX/SET and PUBLISH would come over tcp).
    # The GET and (UN)SUBSCRIBE over tcp are the caller's result.get().
    touching = commands_touching(monitor, result_key)
    writes = [entry for entry in touching if entry[1] in ("SET", "SETEX", "PUBLISH")]
    assert writes == [("lua", "SET"), ("lua", "PUBLISH")], touching
    assert 590 < redis.Redis.from_url(REDIS_URL).ttl(result_key) <= 600


def test_chains_chords_groups_and_ignore_result_behave_as_with_celery(
    make_app: Callable[..., Celery], counter: Counter,
) -> None:
    app = make_app()
    tool = tools(app, counter)
    key = uuid.uuid4().hex[:8]
    with running_worker(app, concurrency=4):
        assert chain(tool["add"].s(1, 2), tool["add"].s(10)).delay().get(timeout=30) == 13
        assert chain(tool["double"].s(1), tool["add"].s(1), tool["double"].s()).delay().get(
            timeout=30) == 6
        assert chord((tool["double"].s(i) for i in range(3)),
                     tool["total"].s()).delay().get(timeout=30) == 6
        assert group(tool["add"].s(i, i) for i in range(4)).delay().get(timeout=30) == [
            0, 2, 4, 6]
        assert chord((tool["add"].s(i, 1) for i in range(3)),
                     tool["total"].s()).delay().get(timeout=30) == 6
        quiet = tool["quiet"].delay(key)
        counter_value = 0
        for _ in range(200):
            counter_value = counter.value(key)
            if counter_value:
                break
            threading.Event().wait(0.05)
    assert counter_value == 1
    assert redis.Redis.from_url(REDIS_URL).exists(
        app.backend.get_key_for_task(quiet.id)) == 0  # ignore_result: nothing stored


def test_another_redis_as_result_backend_is_left_to_celery(
    make_app: Callable[..., Celery], counter: Counter, second_redis: Any,
) -> None:
    app = make_app(result_backend=second_redis.url)
    tool = tools(app, counter)
    assert not backend_is_the_store(app.backend, runtime_for(app))
    with running_worker(app):
        assert tool["add"].delay(2, 3).get(timeout=30) == 5
