"""The README's first command, ``python -m celery_tooleffect.demo``, run as a
user runs it: on the Redis it finds, and on one of its own when none answers.

The demo checks its own results (each run's state, audit trail, journal, the
dead letter, how often each body ran) and exits 0 only when they match the
documentation; these tests assert that exit code and the lines that say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent


def run_demo(redis_url: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery_tooleffect.demo"], cwd=ROOT, capture_output=True,
        text=True, timeout=200, check=False,
        env=dict(os.environ, TOOLEFFECT_DEMO_REDIS_URL=redis_url),
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    return done.stdout


def assert_all_acts(output: str) -> None:
    assert "All as documented" in output
    assert ("cards charged=1 (charge_card's body ran 1 time(s))" in output), output[-3000:]
    assert "refunds made=1" in output and "invoices sent=1" in output
    act5 = output[output.index("5. NON_IDEMPOTENT_WRITE interrupted"):]
    assert "reconcile    applied" in act5 and "result backend: SUCCESS: 'ch_" in act5


def test_the_demo_runs_on_the_redis_it_finds() -> None:
    output = run_demo(REDIS_URL)
    assert f"Broker: the Redis at {REDIS_URL}" in output
    assert_all_acts(output)


def test_the_demo_starts_a_redis_of_its_own_when_none_answers() -> None:
    output = run_demo("redis://127.0.0.1:1/0")
    assert "Broker: a redis-server of the demo's own" in output
    assert_all_acts(output)
