"""The benchmark program works: ``python -m bench --smoke`` (a few hundred calls).

Benchmarks are not tests and nothing here is timed. The smoke run checks that
every phase runs to its end on real workers and a real Redis, that every call
ended in SUCCESS (the program fails otherwise), and that the round trips it
counts are the design's minimum (one per journal step): a count, not a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TESTS

#: Store round trips of one successful call: one per journal transition for a
#: write, the fail-soft audit append for a read (README, "Redis round trips").
STORE_FLOOR = {
    "plain celery (acks_late)": 0,
    "READ_ONLY": 1,
    "IDEMPOTENT_WRITE": 2,
    "NON_IDEMPOTENT_WRITE": 2,
    "NON_IDEMPOTENT_WRITE + deadline": 2,
}


@pytest.mark.timeout(400)
def test_the_benchmark_runs_every_phase_and_counts_the_round_trip_floor(tmp_path: Path) -> None:
    figures_file = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json", str(figures_file)],
        cwd=str(TESTS.parent), capture_output=True, text=True, timeout=380, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(figures_file.read_text())

    variants = figures["variants"]
    assert list(variants) == list(STORE_FLOOR)
    for name, variant in variants.items():
        assert len(variant["rounds"]) == 2 and all(r["calls"] == 100 for r in variant["rounds"])
        assert len(variant["latencies_ms"]) == 20
        store = variant["round_trips"]["store"]
        assert abs(store - STORE_FLOOR[name]) < 0.15, (name, variant["round_trips"])
    broker = {name: variant["round_trips"]["broker"] for name, variant in variants.items()}
    baseline = broker["plain celery (acks_late)"]
    # Securing the lease of a write with a deadline is one broker round trip.
    assert abs(broker["NON_IDEMPOTENT_WRITE + deadline"] - baseline - 1) < 0.15, broker
    assert abs(broker["READ_ONLY"] - baseline) < 0.15, broker
    # One Redis for broker, result backend and store (the common deployment):
    # a read's audit append stores Celery's result (one round trip fewer than
    # plain Celery), a write's outcome does and its intent secures the broker
    # lease (as many as plain Celery).
    one = {name: variant["round_trips"]["one redis"] for name, variant in variants.items()}
    plain = one["plain celery (acks_late)"]
    assert abs(one["READ_ONLY"] - (plain - 1)) < 0.15, one
    for name in ("IDEMPOTENT_WRITE", "NON_IDEMPOTENT_WRITE", "NON_IDEMPOTENT_WRITE + deadline"):
        assert abs(one[name] - plain) < 0.15, (name, one)

    operations = [entry["operation"] for entry in figures["operations"]]
    assert any("dlq list" in operation for operation in operations)
    assert any("dlq replay --all" in operation for operation in operations)
    assert any("audit show" in operation for operation in operations)
    assert "| READ_ONLY |" in done.stdout and "ratio to baseline" in done.stdout
