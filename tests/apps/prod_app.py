"""Tools of the production-Redis tests (tests/test_redis_forms.py,
tests/faults/test_failover.py): a worker on any Redis form kombu accepts.

Configured from the environment: TE_PREFIX (every key of the test),
TE_BROKER (the broker URL, any form), TE_BACKEND (the result backend URL),
TE_TRANSPORT (JSON: extra broker transport options, e.g. ``master_name``),
TE_BACKEND_TRANSPORT (JSON: result backend transport options), TE_SSL (JSON:
``broker_use_ssl``), TE_STORE (``tooleffect_redis_url``, optional),
TE_SETTINGS (JSON: more ``tooleffect_*`` settings), TE_VT (the visibility
timeout, default 30 s), TE_RUNS (a folder: each
body appends a line to the file named by its key, so a count of runs never
depends on the Redis under test).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from tests.conftest import app_config, spawned_setting

PREFIX = spawned_setting("TE_PREFIX")
RUNS = Path(os.environ["TE_RUNS"])


def _json(name: str) -> dict[str, object]:
    return dict(json.loads(os.environ.get(name) or "{}"))


app = Celery("prod_app")
app.conf.update(app_config(
    PREFIX,
    broker_url=spawned_setting("TE_BROKER"),
    result_backend=spawned_setting("TE_BACKEND"),
    broker_transport_options={
        "global_keyprefix": PREFIX, "visibility_timeout": float(os.environ.get("TE_VT", "30")),
        # kombu sweeps unacked messages every interval * throttle seconds.
        "unacked_restore_interval": 1, "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 10, **_json("TE_TRANSPORT"),
    },
    result_backend_transport_options={"global_keyprefix": PREFIX,
                                      **_json("TE_BACKEND_TRANSPORT")},
    broker_use_ssl=_json("TE_SSL") or None,
    redis_backend_use_ssl=_json("TE_SSL") or None,
    tooleffect_redis_url=os.environ.get("TE_STORE") or None,
    worker_hijack_root_logger=True,
    **{"tooleffect_max_retries": 5, **_json("TE_SETTINGS")},
))


def ran(key: str) -> None:
    """Count one run of a body, outside Redis."""
    with (RUNS / key).open("a") as runs:
        runs.write(f"{os.getpid()}\n")


@app.task(base=ToolTask, name="prod.write", effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def write(key: str, hold: float = 0.0) -> str:
    ran(key)
    time.sleep(hold)
    return f"wrote {key}"


@app.task(base=ToolTask, name="prod.write_deadline", effect=ToolEffect.NON_IDEMPOTENT_WRITE,
          operation_deadline=30)
def write_deadline(key: str, hold: float = 0.0) -> str:
    ran(key)
    time.sleep(hold)
    return f"wrote {key}"


@app.task(base=ToolTask, name="prod.idem", effect=ToolEffect.IDEMPOTENT_WRITE)
def idem(key: str, hold: float = 0.0) -> str:
    ran(key)
    time.sleep(hold)
    return f"set {key}"


@app.task(base=ToolTask, name="prod.read")
def read(key: str) -> str:
    ran(key)
    return f"read {key}"
