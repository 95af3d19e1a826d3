"""The crash test in its short form, on each broker (see chaos/crash_test.py for
the long one)."""

from __future__ import annotations

import pytest

from chaos.crash_test import run, split_url
from tests.support import REDIS_URL, TEST_FETCH

#: The seed of each broker's short run (fixed: a failure can be run again).
SEEDS = {"redis": 20261202, "amqp": 20261203}


@pytest.mark.timeout(400)
def test_random_sigkills_never_run_a_non_idempotent_write_twice_nor_lose_a_task(
    broker_url: str,
) -> None:
    # On Redis, the suite's fetch (TOOLEFFECT_TEST_FETCH): the atomic one by default.
    summary = run(kills=10, tasks=60, seed=SEEDS[broker_url.split(":", 1)[0]],
                  broker_url=broker_url, fetch=TEST_FETCH)
    print(summary.line())
    for loss in summary.transport_losses:
        print("lost in kombu's BRPOP window:", loss)
    if broker_url.startswith("redis") and TEST_FETCH == "kombu":
        # kombu's own fetch (tooleffect_atomic_fetch=False) BRPOPs a message and
        # only then records it as unacknowledged: a worker killed between the
        # two loses it before any code of Celery's or the package's sees it
        # (chaos/crash_test.py counts it apart, with the evidence). Every other
        # task ends in exactly one final place.
        assert summary.fetch == "kombu"
        assert summary.lost - summary.lost_in_transport == 0, summary.problems
    else:
        # The atomic fetch records and pops in one script, and RabbitMQ has no
        # such window: nothing is excused.
        assert summary.fetch == ("atomic" if broker_url.startswith("redis") else "amqp")
        assert summary.lost == 0, summary.problems
        assert summary.lost_in_transport == 0
    assert summary.duplicates == 0, summary.problems
    assert summary.problems == []
    assert summary.kills == 10
    assert sum(summary.executions.values()) >= summary.tasks


@pytest.mark.timeout(400)
def test_random_sigkills_lose_nothing_with_results_and_store_in_another_database() -> None:
    """Celery's split deployment: the broker in one database, results and store
    in another of the same server. The outcome's script selects the broker's
    database to acknowledge and the backend's to store the result: a worker
    killed anywhere between the steps still loses nothing and runs no
    non-idempotent write twice."""
    summary = run(kills=10, tasks=60, seed=20261205, broker_url=REDIS_URL, fetch="atomic",
                  store_url=split_url(REDIS_URL))
    print(summary.line())
    assert summary.fetch == "atomic"
    assert summary.lost == 0, summary.problems
    assert summary.lost_in_transport == 0
    assert summary.duplicates == 0, summary.problems
    assert summary.problems == []
    assert summary.kills == 10
    assert sum(summary.executions.values()) >= summary.tasks
