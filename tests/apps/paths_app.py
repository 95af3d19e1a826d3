"""Tools combined with Celery's own options, run by real ``celery worker``s
(tests/test_celery_paths.py).

``build(prefix)`` makes the app; the module's ``app`` is built from the
environment when a worker imports it: TE_PREFIX (every key of the test),
TE_BROKER (default the test Redis; an ``amqp://`` URL for RabbitMQ), and
TE_REFUSED=1 to add a NON_IDEMPOTENT_WRITE declared with ``autoretry_for``
(the worker must refuse to start).

Each body counts its runs in ``<prefix>count:<key>``; a holding body waits
until ``<prefix>release:<key>`` exists (at most 60 s).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from tests.conftest import REDIS_URL, app_config, on_broker, spawned_setting

EFFECTS = {effect.value: effect for effect in ToolEffect}


def build(prefix: str, *, broker_url: str = REDIS_URL, refused: bool = False) -> Celery:
    app = Celery("paths_app", set_as_current=False)
    app.conf.update(app_config(
        prefix,
        **on_broker(prefix, broker_url, unacked_restore_interval=1,
                    unacked_restore_throttle=1),
        worker_hijack_root_logger=True,
    ))
    counters = redis.Redis.from_url(REDIS_URL)

    def count(key: str) -> int:
        return int(counters.incr(f"{prefix}count:{key}"))

    def hold(key: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not counters.exists(f"{prefix}release:{key}"):
            time.sleep(0.02)

    # -- autoretry_for ------------------------------------------------------

    @app.task(base=ToolTask, name="paths.flaky_write", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE, autoretry_for=(ConnectionError,),
              retry_backoff=1, retry_backoff_max=1)
    def flaky_write(key: str, fails: int) -> int:
        runs = count(key)
        if runs <= fails:
            raise ConnectionError(f"{key}: the provider dropped the connection ({runs})")
        return runs

    @app.task(base=ToolTask, name="paths.always_flaky", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE, autoretry_for=(ConnectionError,),
              retry_backoff=True, retry_backoff_max=1, max_retries=1)
    def always_flaky(key: str) -> None:
        runs = count(key)
        raise ConnectionError(f"{key}: the provider dropped the connection ({runs})")

    @app.task(base=ToolTask, name="paths.read_autoretry", shared=False,
              autoretry_for=(ValueError,), dont_autoretry_for=(KeyError,),
              retry_kwargs={"countdown": 0.1})
    def read_autoretry(key: str, fails: int, error: str = "value") -> int:
        runs = count(key)
        if runs <= fails:
            raise (ValueError if error == "value" else KeyError)(f"{key}: bad answer")
        return runs

    if refused:
        @app.task(base=ToolTask, name="paths.refused", shared=False,
                  effect=ToolEffect.NON_IDEMPOTENT_WRITE, autoretry_for=(ConnectionError,),
                  retry_backoff=True)
        def refused_tool(key: str) -> None:
            count(key)

    # -- self.retry() --------------------------------------------------------

    for value, effect in EFFECTS.items():
        def requested(self: Any, key: str, times: int) -> int:
            runs = count(key)
            if runs <= times:
                raise self.retry(countdown=0.1, exc=ConnectionError(f"{key}: not yet"))
            return runs

        requested.__name__ = f"requested_{value}"
        app.task(base=ToolTask, name=f"paths.requested_{value}", shared=False, bind=True,
                 effect=effect)(requested)

    @app.task(base=ToolTask, name="paths.retry_then_wait", shared=False, bind=True,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def retry_then_wait(self: Any, key: str, countdown: float) -> int:
        runs = count(key)
        if runs == 1:
            raise self.retry(countdown=countdown)
        return runs

    @app.task(base=ToolTask, name="paths.retried_headers", shared=False, bind=True,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def retried_headers(self: Any, key: str) -> Any:
        # Celery's own suite (test_task_retried_headers): the custom headers a
        # body reads, returned for the result backend to store.
        if count(key) == 1:
            raise self.retry(countdown=0.1)
        return self.request.headers

    # -- revoke and expires ---------------------------------------------------

    for value, effect in EFFECTS.items():
        def holding(key: str) -> int:
            runs = count(key)
            hold(key)
            return runs

        holding.__name__ = f"hold_{value}"
        app.task(base=ToolTask, name=f"paths.hold_{value}", shared=False,
                 effect=effect)(holding)

    # -- a tool class and its subclass ---------------------------------------

    class Charge(ToolTask):
        name = "paths.charge"
        effect = ToolEffect.NON_IDEMPOTENT_WRITE
        max_retries = 1

        def run(self, amount: int) -> str:
            count("charge")
            return f"charged:{amount}"

    class ChargeInCurrency(Charge):
        name = "paths.charge_in_currency"
        effect = ToolEffect.IDEMPOTENT_WRITE

        def run(self, amount: int, currency: str) -> str:  # type: ignore[override]
            count("charge_in_currency")
            return f"charged:{amount}:{currency}"

    class Quote(ToolTask):
        name = "paths.quote"

        def get_effect(self) -> ToolEffect:
            return ToolEffect.READ_ONLY

        def run(self, item: str) -> str:
            count("quote")
            return f"quote:{item}"

    class QuoteAndReserve(Quote):
        name = "paths.quote_and_reserve"

        def get_effect(self) -> ToolEffect:
            return ToolEffect.IDEMPOTENT_WRITE

        def run(self, item: str, until: str) -> str:  # type: ignore[override]
            count("quote_and_reserve")
            return f"reserved:{item}:{until}"

    for tool in (Charge, ChargeInCurrency, Quote, QuoteAndReserve):
        app.register_task(tool())
    return app


if os.environ.get("TE_PREFIX"):
    app = build(os.environ["TE_PREFIX"], broker_url=spawned_setting("TE_BROKER"),
                refused=os.environ.get("TE_REFUSED") == "1")
