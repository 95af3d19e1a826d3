"""What only RabbitMQ has: quorum queues and their ``x-delivery-limit``.

The scenarios both brokers share (interruptions, Celery's paths, replay, the
crash test) are parametrised on both in their own modules. Real ``celery
worker`` subprocesses on a virtual host of the test's own; every write
heartbeats a short journal lease (``tooleffect_heartbeat_interval`` 0.5 s).
"""

from __future__ import annotations

from collections.abc import Callable

from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters, ToolEffect, ToolTask
from tests.conftest import (
    REDIS_URL,
    Counter,
    RedisServer,
    WorkerProcess,
    on_broker,
    rabbitmq_queues,
    running_worker,
    wait_for,
)


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
                   tooleffect_redis_url=REDIS_URL, tooleffect_heartbeat_interval=0.5,
                   tooleffect_max_retries=3,
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


def test_a_write_whose_outcome_cannot_be_stored_keeps_its_message_until_the_store_is_back(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
    rabbitmq_url: str, prefix: str,
) -> None:
    """On RabbitMQ the dead letters live in the store (there is no broker Redis).
    When the store refuses writes after a NON_IDEMPOTENT_WRITE's body ran, its
    outcome and its dead letter both fail: the message stays in RabbitMQ
    (requeued, never dropped) and the body never runs again; once the store
    accepts writes, the next delivery finds the attempt's lease lapsed and
    dead-letters it ``interrupted_write``."""
    app = make_app(**{**on_broker(prefix, rabbitmq_url), "tooleffect_redis_url": second_redis.url})

    @app.task(base=ToolTask, effect=ToolEffect.NON_IDEMPOTENT_WRITE, name="tools.breaks_store",
              shared=False)
    def breaks_store(key: str) -> str:
        counter.hit(key)
        second_redis.refuse_writes()
        return key

    with running_worker(app):
        result = breaks_store.delay("k")
        wait_for(lambda: counter.value("k") == 1, what="the body to run")
        # Delivered again and again meanwhile: refused before anything runs.
        wait_for(lambda: second_redis.client().info("stats")["total_error_replies"] > 20,
                 what="later deliveries to be refused by the store")
        assert counter.value("k") == 1
        second_redis.accept_writes()
        letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                          what="the dead letter once the store is back")
    assert letter.reason == "interrupted_write"
    assert letter.message is not None  # the message RabbitMQ kept, as delivered
    assert counter.value("k") == 1


def test_a_delivery_deferred_to_a_live_owner_waits_a_fraction_of_consumer_timeout(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, rabbitmq_url: str, prefix: str,
) -> None:
    """The owner's journal lease is 15 s (heartbeat 5 s); a second delivery of
    the same task comes back after a quarter of consumer_timeout (16 s here: 4 s)
    instead, so it is never held unacknowledged long enough for RabbitMQ to
    close the channel. The write runs once."""
    app = make_app(**on_broker(prefix, rabbitmq_url))
    spawn_worker(concurrency=2, broker_url=rabbitmq_url, TE_HEARTBEAT="5",
                 TE_CONSUMER_TIMEOUT="16")
    task_id = app.send_task("tools.write", args=["owned", 8.0], queue="tools").id
    wait_for(lambda: counter.value("owned") == 1, what="the write to start")
    app.send_task("tools.write", args=["owned", 8.0], queue="tools", task_id=task_id)
    deferred = wait_for(
        lambda: [e for e in AuditLog(app).events(task_id) if e["phase"] == "deferred"],
        what="the second delivery to be deferred",
    )
    assert 0 < float(deferred[0]["countdown"]) <= 4.0
    wait_for(lambda: ("duplicate_ignored", "succeeded") in [
        (e["phase"], e["status"]) for e in AuditLog(app).events(task_id)],
        timeout=40, what="the deferred copy to find the write done")
    assert counter.value("owned") == 1
