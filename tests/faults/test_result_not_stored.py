"""The result backend cannot store a tool's result after its body returned.

Found by the broker-restart scenario: Celery stores the result after the body,
outside anything the tool decides, and when that store fails it reports the
task FAILED and, for an ``acks_late`` task, deletes its message. For a read
that was a lost call (its result stored nowhere, no retry, no dead letter).
Here the result backend is a redis-server of the test's own that the body
itself makes refuse writes (OOM) on its first run, and accept them again on
its second: a short outage that spans exactly the first result store.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import RedisServer, wait_for
from tests.conftest import Counter, running_worker
from tests.faults.scenario import broker_holds

pytestmark = pytest.mark.timeout(120)


def define(app: Celery, counter: Counter, backend: RedisServer, effect: ToolEffect) -> object:
    def body(key: str) -> str:
        runs = counter.hit(key)
        if runs == 1:
            backend.refuse_writes()  # the result of this run cannot be stored
        else:
            backend.accept_writes()
        return f"done:{key}"

    return app.task(base=ToolTask, effect=effect, name=f"tools.{effect.value}",
                    shared=False)(body)


def test_a_read_whose_result_cannot_be_stored_runs_again(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
) -> None:
    app = make_app(result_backend=second_redis.url)
    tool = define(app, counter, second_redis, ToolEffect.READ_ONLY)
    with running_worker(app):
        result = tool.delay("k")  # type: ignore[attr-defined]
        assert result.get(timeout=30) == "done:k"
    assert counter.value("k") == 2
    assert DeadLetters(app).get(result.id) is None
    assert [event["status"] for event in AuditLog(app).events(result.id)
            if event["phase"] == "interrupted"] == ["outside_body"]


@pytest.mark.parametrize("effect", [ToolEffect.IDEMPOTENT_WRITE, ToolEffect.NON_IDEMPOTENT_WRITE])
def test_a_write_whose_result_cannot_be_stored_is_acknowledged_once_recorded(
    make_app: Callable[..., Celery], counter: Counter, second_redis: RedisServer,
    main_redis: redis.Redis, prefix: str, effect: ToolEffect,
) -> None:
    """The journal recorded the outcome: the message is acknowledged, never run again.

    The result backend keeps whatever Celery managed to store (here nothing:
    it refused writes), so the journal and the audit log are where such a
    call's success is written down.
    """
    app = make_app(result_backend=second_redis.url)
    tool = define(app, counter, second_redis, effect)
    with running_worker(app):
        result = tool.delay("k")  # type: ignore[attr-defined]
        journal = runtime_for(app).journal
        wait_for(lambda: journal.read(JournalRef(result.id, result.id)).get("state")
                 == "succeeded", what="the outcome in the journal")
        wait_for(lambda: broker_holds(main_redis, prefix) == 0, what="the message to be acked")
    assert counter.value("k") == 1
    assert DeadLetters(app).get(result.id) is None
    phases = [event["phase"] for event in AuditLog(app).events(result.id)]
    assert phases == ["intent", "outcome"], phases
