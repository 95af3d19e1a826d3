"""The tools of the replay tests (tests/test_replay.py), run by real ``celery worker``s.

``build(prefix)`` makes the app; the module's ``app`` is built from the
environment when a worker imports it: TE_PREFIX (every key of the test),
TE_BROKER (default the test Redis; an ``amqp://`` URL for RabbitMQ),
TE_WITHOUT_LATE=1 (``replay.late`` is not registered: its messages are unknown
tasks), TE_ACCEPT (comma-separated accept_content).

A tool fails, non-retryably, while the key ``<prefix>fail:<name>`` exists, so
a test decides when a dead letter happens and when its replay succeeds. Each
body counts its runs in ``<prefix>count:<key>``.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import redis
from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from tests.conftest import REDIS_URL, app_config, on_broker, spawned_setting

ALL_CONTENT = ["json", "msgpack", "yaml", "pickle"]


class ProviderRefused(Exception):
    """A provider's refusal: not retryable, so the call is dead-lettered at once."""

    failure_class = "client_error"


def build(prefix: str, *, broker_url: str = REDIS_URL, accept: list[str] | None = None,
          with_late: bool = True) -> Celery:
    app = Celery("replay_app", set_as_current=False)
    accepted = accept or ALL_CONTENT
    app.conf.update(app_config(
        prefix, accept_content=accepted, result_accept_content=["json"],
        **on_broker(prefix, broker_url, unacked_restore_interval=1,
                    unacked_restore_throttle=1),
    ))
    counters = redis.Redis.from_url(REDIS_URL)

    def count(key: str) -> int:
        return int(counters.incr(f"{prefix}count:{key}"))

    def fail_if_asked(name: str) -> None:
        if counters.exists(f"{prefix}fail:{name}"):
            raise ProviderRefused(f"{name}: the provider refused the call")

    @app.task(base=ToolTask, name="replay.search", shared=False)
    def search(query: str) -> str:
        count("search")
        return f"found:{query}"

    @app.task(base=ToolTask, name="replay.create_ticket", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def create_ticket(found: str) -> str:
        count("create_ticket")
        fail_if_asked("create_ticket")
        return f"ticket:{found}"

    @app.task(base=ToolTask, name="replay.notify", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def notify(ticket: str) -> str:
        count("notify")
        return f"notified:{ticket}"

    @app.task(name="replay.on_success", shared=False)
    def on_success(result: Any) -> None:
        count("on_success")

    @app.task(name="replay.on_error", shared=False)
    def on_error(request: Any, exc: Any, traceback: Any) -> None:
        count("on_error")

    @app.task(base=ToolTask, name="replay.typed", shared=False, bind=True,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def typed(self: Any, *args: Any, **kwargs: Any) -> int:
        """Records what it received, with its types, and which headers came along."""
        runs = count("typed")
        seen = {
            "args": args, "kwargs": kwargs,
            "x_agent_note": getattr(self.request, "x_agent_note", None),
            "traceparent": getattr(self.request, "traceparent", None),
            "retries": self.request.retries,
        }
        counters.rpush(f"{prefix}typed:{self.request.id}", pickle.dumps(seen))
        fail_if_asked("typed")
        return runs

    @app.task(base=ToolTask, name="replay.member", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def member(key: str) -> str:
        count(f"member:{key}")
        fail_if_asked(f"member:{key}")
        deadline = time.monotonic() + 60
        while counters.exists(f"{prefix}hold:{key}") and time.monotonic() < deadline:
            time.sleep(0.02)
        return key

    @app.task(base=ToolTask, name="replay.collect", shared=False)
    def collect(results: list[str]) -> list[str]:
        count("collect")
        return sorted(results)

    if with_late:
        @app.task(base=ToolTask, name="replay.late", shared=False)
        def late(*args: Any, **kwargs: Any) -> str:
            count("late")
            counters.rpush(f"{prefix}late", pickle.dumps((args, kwargs)))
            return "ran"

    return app


if "TE_PREFIX" in os.environ:
    app = build(
        os.environ["TE_PREFIX"],
        broker_url=spawned_setting("TE_BROKER"),
        accept=[name for name in os.environ.get("TE_ACCEPT", "").split(",") if name] or None,
        with_late=os.environ.get("TE_WITHOUT_LATE") != "1",
    )
