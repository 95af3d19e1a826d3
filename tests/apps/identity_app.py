"""Tools for the call-identity tests (tests/test_identity.py), run by real
``celery worker``s.

``build(prefix)`` makes the app; the module's ``app`` is built from the
environment when a worker imports it: TE_PREFIX (every key of the test) and
TE_BROKER (default the test Redis; an ``amqp://`` URL for RabbitMQ). On Redis
the visibility timeout is 6 s, so a message of a killed worker comes back
soon.

Each body counts its runs in ``<prefix>count:<key>`` and records the
idempotency key it saw in ``<prefix>key:<key>``; a parent holds (on its
first run only, when asked) until ``<prefix>release:<key>`` exists.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from tests.conftest import REDIS_URL, app_config, on_broker, spawned_setting

VISIBILITY_TIMEOUT = 6


class Refused(Exception):
    """A provider's refusal: not retried (the parent becomes a dead letter)."""

    failure_class = "client_error"


def build(prefix: str, *, broker_url: str = REDIS_URL) -> Celery:
    app = Celery("identity_app", set_as_current=False)
    app.conf.update(app_config(
        prefix,
        **on_broker(prefix, broker_url, visibility_timeout=VISIBILITY_TIMEOUT,
                    unacked_restore_interval=1, unacked_restore_throttle=1),
        worker_hijack_root_logger=True,
        tooleffect_backoff_base=0.1, tooleffect_backoff_cap=0.5,
    ))
    counters = redis.Redis.from_url(REDIS_URL)

    def count(key: str) -> int:
        return int(counters.incr(f"{prefix}count:{key}"))

    def hold(key: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not counters.exists(f"{prefix}release:{key}"):
            time.sleep(0.02)

    def seen(task: ToolTask, key: str) -> None:
        counters.rpush(f"{prefix}key:{key}", task.idempotency_key)

    @app.task(base=ToolTask, bind=True, name="ident.niw", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def niw(self: ToolTask, key: str) -> str:
        count(key)
        seen(self, key)
        return f"niw:{key}"

    @app.task(base=ToolTask, name="ident.iw", shared=False, effect=ToolEffect.IDEMPOTENT_WRITE)
    def iw(key: str) -> str:
        count(key)
        return f"iw:{key}"

    @app.task(base=ToolTask, name="ident.read", shared=False)
    def read(key: str) -> str:
        count(key)
        return f"read:{key}"

    @app.task(base=ToolTask, name="ident.charge", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def charge(key: str) -> str:
        count(key)
        return f"charged:{key}"

    @app.task(base=ToolTask, bind=True, name="ident.parent", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def parent(self: ToolTask, key: str, fails: int = 0, hold_once: bool = False,
               refuse_once: bool = False) -> list[Any]:
        """Calls ``charge`` directly, with ``.apply()`` and with ``.delay()``, then
        fails ``fails`` times (retried), or holds once, or is refused once."""
        direct = charge(f"{key}-direct")
        applied = charge.apply((f"{key}-apply",)).get(disable_sync_subtasks=False)
        queued = charge.delay(f"{key}-queued")
        runs = count(f"{key}-parent")
        counters.rpush(f"{prefix}children:{key}", queued.id)
        if hold_once and runs == 1:
            hold(key)
        if refuse_once and runs == 1:
            raise Refused(f"{key}: refused the first time")
        if runs <= fails:
            raise ConnectionError(f"{key}: the provider dropped the connection ({runs})")
        return [direct, applied, queued.id]

    @app.task(base=ToolTask, name="ident.flaky_charge", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def flaky_charge(key: str) -> str:
        count(key)
        raise ConnectionError(f"{key}: the provider dropped the connection after charging")

    @app.task(base=ToolTask, name="ident.flaky_parent", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def flaky_parent(key: str) -> str:
        """Retried for its child's ConnectionError; the child is not run again."""
        count(f"{key}-parent")
        return str(flaky_charge(key))

    @app.task(base=ToolTask, name="ident.stepped", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def stepped(key: str, order: list[str], fails: int = 0) -> list[str]:
        """Publishes its children by step key, in the order given."""
        ids = [charge.apply_async((f"{key}-{step}",), step=step).id for step in order]
        if count(f"{key}-stepped") <= fails:
            raise ConnectionError(f"{key}: dropped")
        return ids

    @app.task(base=ToolTask, name="ident.nested", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def nested(key: str, fails: int = 0) -> str:
        """A parent whose child is a parent too: grandchildren keep their ids."""
        inner = parent(f"{key}-inner")
        if count(f"{key}-nested") <= fails:
            raise ConnectionError(f"{key}: dropped ({fails})")
        return str(inner[0])

    return app


if os.environ.get("TE_PREFIX"):
    app = build(os.environ["TE_PREFIX"], broker_url=spawned_setting("TE_BROKER"))
