"""Sentinel fails the store and broker over while writes run (chaos/failover.py
for the long run): a primary, two replicas and three Sentinels, all real
processes; the master is SIGKILLed while writes are in their bodies."""

from __future__ import annotations

import pytest

from chaos.failover import run


@pytest.mark.timeout(400)
def test_a_failover_mid_write_never_runs_a_non_idempotent_write_twice_nor_loses_a_task() -> None:
    summary = run(failovers=2, tasks=8)
    print(summary.line())
    assert summary.failovers == 2
    assert summary.duplicates == 0, summary.problems
    assert summary.lost == 0, summary.problems
    assert summary.broken_chains == 0, summary.problems
    assert summary.problems == []
    assert sum(summary.endings.values()) == summary.tasks == 16
    # Every write of the two batches ran or was settled without running: the
    # non-idempotent ones at most once each (above), the idempotent ones at
    # least once unless dead-lettered.
    assert summary.runs["write"] <= 8
