"""Two releases of one app, for the rolling-upgrade tests (tests/test_upgrade.py).

Release 1 declares its tools READ_ONLY, release 2 NON_IDEMPOTENT_WRITE (the
same body: release 1 had the effect wrong). Configured from the environment:
TE_PREFIX (every key of the test), TE_BROKER (the test Redis, or an
``amqp://`` URL with a vhost of the test's own), TE_RELEASE (``1`` or ``2``,
also ``tooleffect_release``), TE_RUNS (a file: each run of a body appends a
line ``<release> <pid>``), TE_VT (the visibility timeout on Redis, seconds),
TE_HOLD (how long a body holds at most, default 60 s; it stops holding once
the file ``<TE_RUNS>.go`` exists), TE_RETRY_COUNTDOWN (the countdown of
``t.retrying``'s retry), TE_DECLARE_INTERVAL (seconds between two refreshes of
the effects the worker publishes; default the package's).

- ``t.changing(key)``: counts, holds, returns ``key``.
- ``t.retrying(key)``: on release 2 its first attempt counts and asks for a
  retry (``self.retry``: the tool's own decision, the one way a
  NON_IDEMPOTENT_WRITE runs again); every other run counts and holds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from celery_tooleffect.worker.startup import DeclaredEffects
from tests.conftest import app_config, on_broker, spawned_setting

PREFIX = spawned_setting("TE_PREFIX")
BROKER = spawned_setting("TE_BROKER")
RELEASE = os.environ["TE_RELEASE"]
RUNS = Path(os.environ.get("TE_RUNS") or os.devnull)
EFFECT = {"1": ToolEffect.READ_ONLY, "2": ToolEffect.NON_IDEMPOTENT_WRITE}[RELEASE]

app = Celery("upgrade_app")
app.conf.update(app_config(
    PREFIX,
    **on_broker(PREFIX, BROKER, visibility_timeout=float(os.environ.get("TE_VT") or 60),
                # kombu sweeps unacked messages every second (not every 100 s),
                # and a mutex a killed worker left lapses within seconds.
                unacked_restore_interval=1, unacked_restore_throttle=1,
                unacked_mutex_expire=10),
    tooleffect_release=RELEASE,
    worker_hijack_root_logger=True,
))
if os.environ.get("TE_DECLARE_INTERVAL"):
    DeclaredEffects.interval = float(os.environ["TE_DECLARE_INTERVAL"])


def count_and_hold(key: str) -> str:
    """The side effect: one line in the runs file, then hold until told."""
    with RUNS.open("a") as runs:  # one short append per run: lines never interleave
        runs.write(f"{RELEASE} {os.getpid()}\n")
    go = RUNS.with_name(RUNS.name + ".go")
    deadline = time.monotonic() + float(os.environ.get("TE_HOLD") or 60)
    while time.monotonic() < deadline and not go.exists():
        time.sleep(0.02)
    return key


@app.task(base=ToolTask, name="t.changing", effect=EFFECT)
def changing(key: str) -> str:
    return count_and_hold(key)


@app.task(base=ToolTask, name="t.retrying", effect=EFFECT, bind=True)
def retrying(self: Any, key: str) -> str:
    if RELEASE == "2" and self.request.retries == 0:
        with RUNS.open("a") as runs:
            runs.write(f"{RELEASE} {os.getpid()}\n")
        raise self.retry(countdown=float(os.environ.get("TE_RETRY_COUNTDOWN") or 5))
    return count_and_hold(key)
