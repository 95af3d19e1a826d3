"""The prefetch multiplier the start-up check recommends, per pool
(``celery_tooleffect.worker.startup.prefetch_advice``)."""

from __future__ import annotations

import pytest
from celery.concurrency import get_implementation

from celery_tooleffect.worker.startup import GREEN_PREFETCH, prefetch_advice


class GreenPool:
    """A pool class as Celery's gevent and eventlet ones are (not imported:
    neither library is a dependency)."""

    is_green = True


GreenPool.__module__ = "celery.concurrency.gevent"


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_an_event_loop_pool_is_told_to_prefetch_one(pool: str) -> None:
    pool_cls = get_implementation(pool)
    assert prefetch_advice(1, pool_cls) is None
    advice = prefetch_advice(4, pool_cls)
    assert advice == (f"4 on the {pool} pool; 1 is recommended there (prefetched messages "
                      "wait with their visibility timeout running, and the worker fetches "
                      "as soon as a call ends)")


def test_a_worker_of_unknown_pool_is_advised_as_prefork() -> None:
    assert prefetch_advice(2, None) is not None
    assert "on the prefork pool" in (prefetch_advice(2, None) or "")


def test_a_green_pool_is_told_that_one_caps_it() -> None:
    assert prefetch_advice(GREEN_PREFETCH, GreenPool) is None
    assert prefetch_advice(2, GreenPool) is None
    assert prefetch_advice(1, GreenPool) == (
        "1 on a green pool (gevent); 4 is recommended there: its consumer fetches only when "
        "its poll wakes, so 1 caps it near its concurrency in calls a second")
