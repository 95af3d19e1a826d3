"""An app whose every task is a tool through ``task_cls`` (no ``base=``), for
tests/test_celery_semantics.py: what Celery users rely on when a task fails.

Configured from the environment: TE_PREFIX (every key of the test), TE_BROKER
(the test Redis, or an ``amqp://`` URL with a vhost of the test's own). Each
failure Celery reports through ``task_failure`` is recorded in
``<prefix>failures`` as ``<task name> <exception type>``; errbacks record what
they received in ``<prefix>errbacks``.
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery
from celery.signals import task_failure

from celery_tooleffect import ToolEffect
from tests.conftest import REDIS_URL, app_config, on_broker, spawned_setting

PREFIX = spawned_setting("TE_PREFIX")
BROKER = spawned_setting("TE_BROKER")

app = Celery("semantics_app", task_cls="celery_tooleffect:ToolTask")
app.conf.update(app_config(PREFIX, **on_broker(PREFIX, BROKER), worker_hijack_root_logger=True))
recorder = redis.Redis.from_url(REDIS_URL)


class ExpectedException(Exception):
    """What the failing tools raise (not retryable: unknown failure class)."""


class UnpickleableException(Exception):
    """Cannot be unpickled: its ``__init__`` needs ``bar``, which pickle does not
    pass (Celery's ``t/integration/tasks.py`` has the same one)."""

    def __init__(self, foo: str, bar: str | None = None) -> None:
        if bar is None:
            raise TypeError("bar must be provided")
        super().__init__(foo)
        self.bar = bar


@task_failure.connect
def record_failure(sender: Any = None, exception: BaseException | None = None,
                   **_: Any) -> None:
    recorder.rpush(f"{PREFIX}failures", f"{sender.name} {type(exception).__name__}")


@app.task(name="sem.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="sem.fail")
def fail(*args: Any) -> None:
    raise ExpectedException("Task expected to fail", *args)


@app.task(name="sem.fail_write", effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def fail_write() -> None:
    raise ExpectedException("a write that failed")


@app.task(name="sem.unpickleable")
def unpickleable() -> None:
    raise UnpickleableException("foo", "bar")


@app.task(name="sem.unserializable")
def unserializable() -> None:
    """Its argument is no JSON (the result serializer here): Celery stores its repr."""
    raise ExpectedException({1, 2, 3}, object())


@app.task(name="sem.huge")
def huge(size: int) -> None:
    raise ValueError("x" * size)


@app.task(name="sem.deep")
def deep(depth: int) -> None:
    """Raises an exception chained ``depth`` deep (each ``raise ... from``)."""
    error: BaseException = ValueError("level 0")
    for level in range(1, depth):
        try:
            raise ValueError(f"level {level}") from error
        except ValueError as chained:
            error = chained
    raise error


@app.task(name="sem.retry_spent", bind=True, max_retries=1)
def retry_spent(self: Any) -> None:
    raise self.retry(exc=ExpectedException("retried"), countdown=0.1)


@app.task(name="sem.errback")
def errback(request: Any, exc: BaseException, traceback: str) -> None:
    recorder.rpush(f"{PREFIX}errbacks", f"{request.id} {type(exc).__name__} {exc.args[0]}")


@app.task(name="sem.errback_old_style")
def errback_old_style(task_id: str) -> None:
    recorder.rpush(f"{PREFIX}errbacks", f"{task_id} old-style")


@app.task(name="sem.tsum")
def tsum(values: list[int]) -> int:
    return sum(values)
