"""A write whose outcome script ran but whose reply was lost (a Redis that
restarts from an fsynced AOF between the two) is not failed closed: the
worker reads what the store holds before it dead-letters
(``worker/execution.outcome_landed``). With a real ``redis-server`` killed
and started again from its AOF while the worker asks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from celery import Celery

from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import redis_server
from celery_tooleffect.worker.execution import outcome_landed


@dataclass(frozen=True)
class Attempt:
    """What outcome_landed reads of an attempt: its entry and its owner token."""

    ref: JournalRef
    token: str


def entry(app: Celery, ref: JournalRef, **fields: str) -> None:
    runtime = runtime_for(app)
    runtime.journal.client.hset(runtime.journal.keys.journal(ref.run_id, ref.task_id),
                                mapping=fields)


def test_an_outcome_the_store_took_is_found_after_a_restart(
    make_app: Callable[..., Celery],
) -> None:
    with redis_server("--appendfsync", "always", appendonly=True) as server:
        app = make_app(broker_url="memory://", tooleffect_redis_url=server.url)
        ours = Attempt(JournalRef("run-1", "t-1"), token="owner-a")
        entry(app, ours.ref, state="succeeded", owner="owner-a")
        server.kill()  # the reply is lost with the connection
        comes_back = threading.Thread(target=server.start)
        comes_back.start()
        try:
            assert outcome_landed(runtime_for(app), ours, wait=30.0)
        finally:
            comes_back.join(30)
        # Another attempt's success, or an entry still running, is not ours.
        assert not outcome_landed(runtime_for(app), Attempt(ours.ref, token="owner-b"))
        running = Attempt(JournalRef("run-1", "t-2"), token="owner-a")
        entry(app, running.ref, state="running", owner="owner-a")
        assert not outcome_landed(runtime_for(app), running)


def test_a_store_that_stays_down_fails_the_write_closed(
    make_app: Callable[..., Celery],
) -> None:
    with redis_server() as server:
        app = make_app(broker_url="memory://", tooleffect_redis_url=server.url)
        server.kill()
        attempt = Attempt(JournalRef("run-1", "t-1"), token="owner-a")
        assert not outcome_landed(runtime_for(app), attempt, wait=0.5)
