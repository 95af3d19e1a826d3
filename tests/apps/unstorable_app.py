"""Tools whose result the app's result serializer cannot encode (issue 38).

``build(prefix, ...)`` makes the app; the module's ``app`` is built from the
environment when a worker imports it: TE_PREFIX (every key of the test),
TE_BROKER (the test's Redis, also the store), TE_RESULTS (a result backend
that is not the store's Redis; default: the broker's, which is the store),
TE_SERIALIZER (``result_serializer`` and what results accept; default json).

One tool per effect, ``unstorable.<effect>``: it counts its runs in
``<prefix>count:<key>`` and returns what its ``kind`` names: ``set`` (a
``set``, which JSON cannot encode) or ``lock`` (a lock, which pickle refuses).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from tests.conftest import REDIS_URL, app_config, spawned_setting


def build(prefix: str, *, broker_url: str = REDIS_URL, result_backend: str | None = None,
          serializer: str = "json") -> Celery:
    app = Celery("unstorable_app", set_as_current=False)
    app.conf.update(app_config(
        prefix, broker_url=broker_url, result_backend=result_backend or broker_url,
        result_serializer=serializer, result_accept_content=[serializer, "json"],
        worker_hijack_root_logger=True,
    ))
    counters = redis.Redis.from_url(REDIS_URL)

    def unstorable(key: str, kind: str) -> Any:
        counters.incr(f"{prefix}count:{key}")
        return threading.Lock() if kind == "lock" else {key}

    for effect in ToolEffect:
        app.task(base=ToolTask, name=f"unstorable.{effect.value}", effect=effect,
                 shared=False)(unstorable)
    return app


if os.environ.get("TE_PREFIX"):
    app = build(os.environ["TE_PREFIX"], broker_url=spawned_setting("TE_BROKER"),
                result_backend=os.environ.get("TE_RESULTS") or None,
                serializer=os.environ.get("TE_SERIALIZER") or "json")
