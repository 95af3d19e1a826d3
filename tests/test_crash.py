"""The crash test in its short form (see chaos/crash_test.py for the long one)."""

from __future__ import annotations

import pytest

from chaos.crash_test import run


@pytest.mark.timeout(400)
def test_random_sigkills_never_run_a_non_idempotent_write_twice_nor_lose_a_task() -> None:
    summary = run(kills=10, tasks=60, seed=20261202)
    print(summary.line())
    assert summary.lost == 0, summary.problems
    assert summary.duplicates == 0, summary.problems
    assert summary.problems == []
    assert summary.kills == 10
    assert sum(summary.executions.values()) >= summary.tasks


@pytest.mark.timeout(400)
def test_the_crash_test_on_rabbitmq(rabbitmq_url: str) -> None:
    summary = run(kills=10, tasks=60, seed=20261203, broker_url=rabbitmq_url)
    print(summary.line())
    assert summary.lost == 0, summary.problems
    assert summary.duplicates == 0, summary.problems
    assert summary.problems == []
    assert summary.kills == 10
    assert sum(summary.executions.values()) >= summary.tasks
