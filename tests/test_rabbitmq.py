"""RabbitMQ as the broker (the store stays on Redis): how a write's owner is
found dead without a visibility timeout.

RabbitMQ gives a message back as soon as the channel that held it closes, so
every write heartbeats a short journal lease (``tooleffect_heartbeat_interval``,
0.5 s here: the lease is 1.5 s). Real ``celery worker`` subprocesses on a
virtual host of the test's own; the whole first worker is SIGKILLed mid-write.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from celery import Celery

from celery_tooleffect import DeadLetters
from tests.conftest import REDIS_URL, Counter, WorkerProcess, rabbitmq_queues, wait_for


@pytest.mark.parametrize(("tool", "effect"), [("tools.write", "non_idempotent_write"),
                                              ("tools.idempotent", "idempotent_write")])
def test_a_write_whose_worker_died_is_settled_within_one_journal_lease(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, rabbitmq_url: str, tool: str, effect: str,
) -> None:
    app = make_app(broker_url=rabbitmq_url, result_backend=REDIS_URL,
                   tooleffect_heartbeat_interval=0.5)
    first = spawn_worker(broker_url=rabbitmq_url, TE_HEARTBEAT="0.5")
    task_id = app.send_task(tool, args=["held", 30.0], queue="tools").id
    wait_for(lambda: counter.value("held") == 1, what="the write to start")
    first.kill()
    spawn_worker(broker_url=rabbitmq_url, TE_HEARTBEAT="0.5")
    # Bounded by 30 s: without the journal heartbeat the redelivery would be
    # deferred for the hour of a visibility timeout RabbitMQ does not have.
    if effect == "non_idempotent_write":
        letter = wait_for(lambda: DeadLetters(app).get(task_id), timeout=30,
                          what="the interrupted write's dead letter")
        assert letter.reason == "interrupted_write"
        assert counter.value("held") == 1
    else:
        wait_for(lambda: app.AsyncResult(task_id).state == "SUCCESS", timeout=30,
                 what="the idempotent write to run again")
        assert counter.value("held") == 2


def test_tools_on_a_quorum_queue_with_a_delivery_limit_above_the_budget(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, rabbitmq_url: str,
) -> None:
    """A quorum queue (``x-delivery-limit`` 10): the effects run once; an
    IDEMPOTENT_WRITE whose worker is killed on every run is redelivered by
    RabbitMQ each time, and it is the package's budget (3 retries: 4 attempts)
    that ends it as a dead letter, before RabbitMQ's limit would drop it."""
    quorum = {"TE_QUEUE_TYPE": "quorum", "TE_DELIVERY_LIMIT": "10", "TE_HEARTBEAT": "0.5"}
    app = make_app(broker_url=rabbitmq_url, result_backend=REDIS_URL,
                   tooleffect_heartbeat_interval=0.5, tooleffect_max_retries=3,
                   **rabbitmq_queues("quorum", delivery_limit=10))
    worker = spawn_worker(broker_url=rabbitmq_url, **quorum)
    ids = {tool: app.send_task(tool, args=[tool, 0.0], queue="tools").id
           for tool in ("tools.read", "tools.idempotent", "tools.write")}
    for tool, task_id in ids.items():
        wait_for(lambda task_id=task_id: app.AsyncResult(task_id).state == "SUCCESS",
                 what=f"{tool} to succeed")
        assert counter.value(tool) == 1

    task_id = app.send_task("tools.slow_idempotent", args=["killed", 60.0], queue="tools").id
    for run in range(1, 5):
        wait_for(lambda run=run: counter.value("killed") == run, timeout=30,
                 what=f"run {run} of the write")
        worker.kill()
        worker = spawn_worker(broker_url=rabbitmq_url, **quorum)
    letter = wait_for(lambda: DeadLetters(app).get(task_id), timeout=30,
                      what="the package's dead letter")
    assert letter.reason == "retries_exhausted"
    assert "4 attempt(s)" in letter.error and "4 interrupted" in letter.error
    assert counter.value("killed") == 4
