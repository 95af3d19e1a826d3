"""Invariant: a message leaves the broker only when its success is recorded, its
dead letter is stored, or its retry was published.

The faults are real Redis ACL restrictions on the worker's broker user: it may
consume and acknowledge, but may not write dead letters (first test) or may
not publish (second test), until the test grants the permission back.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis
from celery import Celery

from celery_tooleffect import DeadLetters, ToolEffect, ToolTask
from tests.conftest import REDIS_URL, Counter, running_worker, wait_for

pytestmark = pytest.mark.timeout(120)


@dataclass
class AclUser:
    name: str
    password: str
    client: redis.Redis

    @property
    def url(self) -> str:
        return REDIS_URL.replace("redis://", f"redis://{self.name}:{self.password}@", 1)

    def set(self, *rules: str) -> None:
        """Replace the user's rules in one atomic ACL SETUSER."""
        self.client.execute_command(
            "ACL", "SETUSER", self.name, "reset", "on", f">{self.password}", "&*", *rules
        )


@pytest.fixture
def acl_user(main_redis: redis.Redis) -> Iterator[AclUser]:
    user = AclUser(f"tetest-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, main_redis)
    yield user
    main_redis.acl_deluser(user.name)


def broker_keys(prefix: str) -> list[str]:
    """Every key of the prefix but the package's own (``<prefix>te:``).

    kombu's queue, unacked hash and index, bindings and pidbox all match.
    """
    return [f"~{prefix}[^t]*", f"~{prefix}tools*"]


def in_broker(client: redis.Redis, prefix: str) -> int:
    """Messages of the queue that are still in the broker, waiting or unacked."""
    return int(client.llen(f"{prefix}tools")) + int(client.hlen(f"{prefix}unacked"))


def test_message_is_kept_until_its_dead_letter_is_stored(
    make_app: Callable[..., Celery], counter: Counter, acl_user: AclUser,
    main_redis: redis.Redis, prefix: str,
) -> None:
    acl_user.set("+@all", *broker_keys(prefix))  # everything but the dead-letter keys
    worker_app = make_app(broker_url=acl_user.url, tooleffect_redis_url=REDIS_URL)
    producer_app = make_app()

    @worker_app.task(base=ToolTask, name="tools.send", shared=False,
                     effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send(key: str) -> str:
        counter.hit(key)
        raise ValueError("provider rejected the request")

    with running_worker(worker_app):
        result = producer_app.send_task("tools.send", args=["k"], queue="tools")
        journal_key = f"{prefix}te:{{{result.id}}}:journal:{result.id}"
        wait_for(lambda: main_redis.hget(journal_key, "state") == b"dead_lettering",
                 what="the journal to begin the dead letter")
        assert DeadLetters(producer_app).get(result.id) is None
        # Kept, not deleted: it keeps coming back (between kombu's BRPOP and
        # its unacked bookkeeping it is briefly in neither key, hence a poll).
        for _ in range(3):
            wait_for(lambda: in_broker(main_redis, prefix) >= 1, what="the message in the broker")
            assert DeadLetters(producer_app).get(result.id) is None

        acl_user.set("+@all", *broker_keys(prefix), f"~{prefix}te:*")
        letter = wait_for(lambda: DeadLetters(producer_app).get(result.id),
                          what="the dead letter once it can be stored")
        wait_for(lambda: in_broker(main_redis, prefix) == 0, what="the message to leave")
    assert counter.value("k") == 1
    assert letter.reason == "not_retryable"
    assert main_redis.hget(journal_key, "state") == b"dead_lettered"


def test_a_retry_that_cannot_be_published_requeues_the_message(
    make_app: Callable[..., Celery], counter: Counter, acl_user: AclUser,
    main_redis: redis.Redis, prefix: str,
) -> None:
    # The worker publishes through broker_write_url, a user that may not
    # LPUSH (kombu's publish); it consumes, acknowledges and requeues through
    # broker_read_url, which may.
    acl_user.set("+@all", "-lpush", *broker_keys(prefix))
    worker_app = make_app(broker_read_url=REDIS_URL, broker_write_url=acl_user.url,
                          task_publish_retry=False, tooleffect_redis_url=REDIS_URL)
    producer_app = make_app()
    retries_seen: list[int] = []

    @worker_app.task(base=ToolTask, name="tools.upsert", shared=False, bind=True,
                     effect=ToolEffect.IDEMPOTENT_WRITE)
    def upsert(self: ToolTask, key: str) -> str:
        retries_seen.append(int(self.request.retries or 0))
        if counter.hit(key) == 1:
            raise ConnectionError("provider unreachable")
        return key

    with running_worker(worker_app):
        result = producer_app.send_task("tools.upsert", args=["k"], queue="tools")
        assert result.get(timeout=30) == "k"
        wait_for(lambda: in_broker(main_redis, prefix) == 0, what="the message to leave")
    assert counter.value("k") == 2
    # The second run is the original message, requeued (retries 0), not a
    # published retry (retries 1): Celery alone would have deleted it.
    assert retries_seen == [0, 0]
