"""Leases on kombu's Redis transport, operation_deadline, fencing and start checks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from kombu import Connection, Queue

from celery_tooleffect import AuditLog, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.leases import Leases, LeaseVerdict
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import Verdict
from celery_tooleffect.worker.attempt import Attempt
from celery_tooleffect.worker.startup import run_checks
from tests.conftest import (
    RABBITMQ_URL,
    REDIS_URL,
    Counter,
    WorkerProcess,
    running_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)


def delivered(conn: Connection, name: str) -> Any:
    """A message published to queue ``name`` and delivered (held unacknowledged)."""
    queue = Queue(name, routing_key=name)
    with conn.Producer() as producer:
        producer.publish({"n": 1}, routing_key=name, declare=[queue])
    return wait_for(lambda: conn.SimpleQueue(queue).get(timeout=1), what="a message")


def test_extend_lease_answers_ok_busy_and_lost(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str
) -> None:
    app = make_app(broker_transport_options={"global_keyprefix": prefix,
                                             "visibility_timeout": 30})
    leases = Leases(runtime_for(app).settings)
    with Connection(app.conf.broker_url,
                    transport_options=app.conf.broker_transport_options) as conn:
        message = delivered(conn, "lease-test")
        lease = leases.broker_lease(message.properties)
        assert lease is not None
        index = f"{prefix}unacked_index"
        delivered_at = main_redis.zscore(index, lease.tag)
        assert delivered_at is not None

        until = time.time() + 300
        assert leases.extend_lease(lease, until) is LeaseVerdict.OK
        assert main_redis.zscore(index, lease.tag) == pytest.approx(until - 30, abs=0.01)
        # Never moved back.
        assert leases.extend_lease(lease, until - 100) is LeaseVerdict.OK
        assert main_redis.zscore(index, lease.tag) == pytest.approx(until - 30, abs=0.01)

        main_redis.set(f"{prefix}unacked_mutex", "sweep", ex=1)
        leases.BUSY_RETRIES = 2
        assert leases.extend_lease(lease, until + 1) is LeaseVerdict.BUSY
        main_redis.delete(f"{prefix}unacked_mutex")

        message.ack()
        assert leases.extend_lease(lease, until + 2) is LeaseVerdict.LOST


def test_the_intent_secures_the_lease_when_the_broker_is_the_store(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str, second_redis: Any,
) -> None:
    """One round trip: the lease is raised by begin_attempt's own script, and
    when it cannot be (a restore sweep holds the mutex, the message was
    restored or acknowledged) nothing at all is recorded."""
    app = make_app(broker_transport_options={"global_keyprefix": prefix,
                                             "visibility_timeout": 30})
    runtime = runtime_for(app)
    assert runtime.leases.shares_the_store
    apart = make_app(tooleffect_redis_url=second_redis.url)
    assert not runtime_for(apart).leases.shares_the_store
    with Connection(app.conf.broker_url,
                    transport_options=app.conf.broker_transport_options) as conn:
        message = delivered(conn, "lease-intent")
        lease = runtime.leases.broker_lease(message.properties)
        assert lease is not None
        index = f"{prefix}unacked_index"
        context = Attempt(task_id="t", run_id="r", name="t",
                          effect=ToolEffect.NON_IDEMPOTENT_WRITE, queue="q", token="",
                          redelivered=False, interactive=False, retries=0).context

        def begin(ref: JournalRef, until: float) -> Any:
            return runtime.journal.begin_attempt(
                ref, token=uuid.uuid4().hex, effect="non_idempotent_write",
                lease_end=time.time() + 30, attempts_allowed=3,
                event=context.event("intent", "started"),
                broker_lease=lease, broker_lease_end=until,
            )

        def untouched(ref: JournalRef) -> bool:
            return not runtime.journal.read(ref) and not AuditLog(app).events(ref.run_id)

        until = time.time() + 300
        busy = JournalRef(f"{prefix}busy", f"{prefix}busy")
        main_redis.set(f"{prefix}unacked_mutex", "sweep", ex=5)
        assert begin(busy, until).verdict is Verdict.LEASE_BUSY
        main_redis.delete(f"{prefix}unacked_mutex")
        assert untouched(busy)
        assert main_redis.zscore(index, lease.tag) < until - 60  # type: ignore[operator]

        secured = JournalRef(f"{prefix}ok", f"{prefix}ok")
        assert begin(secured, until).verdict is Verdict.STARTED
        assert main_redis.zscore(index, lease.tag) == pytest.approx(until - 30, abs=0.01)
        assert runtime.journal.read(secured)["state"] == "running"

        message.ack()
        lost = JournalRef(f"{prefix}lost", f"{prefix}lost")
        assert begin(lost, until + 5).verdict is Verdict.LEASE_LOST
        assert untouched(lost)
        assert main_redis.zscore(index, lease.tag) is None


def test_a_deadline_secures_the_lease_before_the_body_and_audits_it(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str, counter: Counter
) -> None:
    app = make_app()
    seen: dict[str, float] = {}

    @app.task(base=ToolTask, name="tools.slow", shared=False, bind=True,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=100)
    def slow(self: ToolTask, key: str) -> str:
        tag = self.request.properties["delivery_tag"]
        seen["score"] = float(main_redis.zscore(f"{prefix}unacked_index", tag) or 0)
        counter.hit(key)
        return key

    with running_worker(app):
        sent_at = time.time()
        result = slow.delay("k")
        assert result.get(timeout=20) == "k"
    # Held until the deadline: score = deadline end - visibility timeout (60 s),
    # where kombu's own score (the delivery time) would have let it go at +60 s.
    assert seen["score"] == pytest.approx(sent_at + 100 - 60, abs=5)
    intent = AuditLog(app).events(result.id)[0]
    assert intent["phase"] == "intent" and float(intent["lease_until"]) > sent_at + 99


def test_a_lost_lease_leaves_the_outcome_as_a_late_outcome_on_the_dead_letter(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str, counter: Counter
) -> None:
    """Fencing: a worker whose attempt was taken over does not settle it."""
    app = make_app()
    release = f"{prefix}release"

    @app.task(base=ToolTask, name="tools.slow", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def slow(key: str) -> str:
        counter.hit(key)
        wait_for(lambda: main_redis.exists(release), timeout=30, what="release")
        return key

    with running_worker(app):
        result = slow.delay("k")
        wait_for(lambda: counter.value("k") == 1, what="the body to start")
        # The journal's lease lapses while the body still runs (as when a
        # worker is stuck past its visibility timeout) ...
        journal_key = f"{prefix}te:{{{result.id}}}:journal:{result.id}"
        main_redis.hset(journal_key, "lease_end", "1")
        # ... and the message is delivered again: that delivery dead-letters it.
        slow.apply_async(("k",), task_id=result.id)
        letter = wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
        assert letter.reason == "interrupted_write"
        main_redis.set(release, 1)
        wait_for(lambda: DeadLetters(app).get(result.id).late_outcomes,  # type: ignore[union-attr]
                 what="the late outcome on the dead letter")
    assert counter.value("k") == 1
    phases = [e["phase"] for e in AuditLog(app).events(result.id)]
    assert phases[:2] == ["intent", "interrupted"]
    assert "late_outcome" in phases and phases.count("intent") == 1
    late = DeadLetters(app).get(result.id).late_outcomes[0]  # type: ignore[union-attr]
    assert late["status"] == "succeeded"
    assert main_redis.hget(journal_key, "state") == b"dead_lettered"


def test_a_second_delivery_while_the_owner_runs_is_deferred_then_settled(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str, counter: Counter
) -> None:
    app = make_app()
    release = f"{prefix}release"

    @app.task(base=ToolTask, name="tools.slow", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE, operation_deadline=20)
    def slow(key: str) -> str:
        counter.hit(key)
        wait_for(lambda: main_redis.exists(release), timeout=30, what="release")
        return key

    with running_worker(app, concurrency=2):
        result = slow.delay("k")
        wait_for(lambda: counter.value("k") == 1, what="the body to start")
        slow.apply_async(("k",), task_id=result.id)
        wait_for(lambda: "deferred" in [e["phase"] for e in AuditLog(app).events(result.id)],
                 what="the second delivery to be deferred")
        main_redis.set(release, 1)
        assert result.get(timeout=20) == "k"
        wait_for(lambda: "duplicate_ignored" in
                 [e["phase"] for e in AuditLog(app).events(result.id)],
                 timeout=30, what="the deferred delivery to come back and be acknowledged")
    assert counter.value("k") == 1


def noop() -> None:
    return None


def test_worker_refuses_a_backoff_cap_beyond_the_visibility_timeout(
    make_app: Callable[..., Celery]
) -> None:
    app = make_app(tooleffect_backoff_cap=120.0)  # visibility timeout is 60 s
    app.task(base=ToolTask, name="tools.x", shared=False)(noop)
    with pytest.raises(ImproperlyConfigured, match="tooleffect_backoff_cap"):
        run_checks(app)
    with pytest.raises(ImproperlyConfigured, match="tooleffect_backoff_cap"), \
            running_worker(app):
        pass


def test_worker_refuses_a_deadline_beyond_rabbitmq_consumer_timeout(
    make_app: Callable[..., Celery]
) -> None:
    # Never connected to: the start-up checks refuse it first.
    app = make_app(broker_url=f"{RABBITMQ_URL}/te-never-connected", tooleffect_redis_url=REDIS_URL,
                   tooleffect_rabbitmq_consumer_timeout=60)
    app.task(base=ToolTask, name="tools.x", shared=False, operation_deadline=120,
             effect=ToolEffect.NON_IDEMPOTENT_WRITE)(noop)
    with pytest.raises(ImproperlyConfigured, match="consumer_timeout"):
        run_checks(app)


def test_worker_warns_about_a_store_that_persists_nothing(
    make_app: Callable[..., Celery], second_redis: object, caplog: pytest.LogCaptureFixture
) -> None:
    # The suite's apps accept a volatile store (tests/support.py): a warning.
    app = make_app(tooleffect_redis_url=second_redis.url,  # type: ignore[attr-defined]
                   worker_prefetch_multiplier=4)
    run_checks(app)
    text = caplog.text
    assert ("VOLATILE STORE ALLOWED (tooleffect_allow_volatile_store = True): the journal "
            "and audit store") in text
    assert "(no AOF and no RDB snapshots, read by CONFIG GET)" in text
    assert "worker_prefetch_multiplier is 4" in text
    # Each names the section of the docs that says what it means and what to do.
    assert "see docs/operations.md#prefetch" in text
    assert "see docs/operations.md#persistence" in text


# -- with real worker processes and a short visibility timeout ------------------------


@pytest.mark.parametrize("tool", ["tools.write_deadline", "tools.write"])
def test_a_deadline_longer_than_the_visibility_timeout_runs_once(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess],
    counter: Counter, prefix: str, tool: str,
) -> None:
    """vt 3 s, two workers, a 9 s write: with a 12 s deadline it is never
    delivered again; without one it is, and the journal dead-letters the copy."""
    visibility_timeout = 3.0
    app = make_app(broker_transport_options={"global_keyprefix": prefix,
                                             "visibility_timeout": visibility_timeout})
    workers = [spawn_worker(concurrency=1, visibility_timeout=visibility_timeout)
               for _ in range(2)]
    key = uuid.uuid4().hex[:8]
    result = app.send_task(tool, args=[key, 9.0], queue="tools")
    if tool == "tools.write_deadline":
        assert result.get(timeout=60) == key
        phases = [e["phase"] for e in AuditLog(app).events(result.id)]
        assert phases == ["intent", "outcome"], workers[1].output()[-2000:]
        assert DeadLetters(app).get(result.id) is None
    else:
        letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=60,
                          what="the redelivered copy to be dead-lettered")
        assert letter.reason == "interrupted_write"
        wait_for(lambda: DeadLetters(app).get(result.id).late_outcomes,  # type: ignore[union-attr]
                 timeout=60, what="the first run's late outcome")
    assert counter.value(key) == 1


def test_one_heartbeat_thread_keeps_every_running_write_of_a_process_alive(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str, counter: Counter
) -> None:
    """Three writes run at once in one process (threads pool) for longer than the
    visibility timeout: the process's one heartbeat thread renews all their
    leases, so none is restored, redelivered or dead-lettered."""
    app = make_app(
        broker_transport_options={"global_keyprefix": prefix, "visibility_timeout": 2,
                                  "unacked_restore_interval": 1,
                                  "unacked_restore_throttle": 1},
        tooleffect_heartbeat_interval=0.3,
    )

    journal = runtime_for(app).journal

    @app.task(base=ToolTask, name="tools.long_write", shared=False, bind=True,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=20)
    def long_write(self: ToolTask, key: str) -> str:
        counter.hit(key)
        started = time.time()
        ref = JournalRef(str(self.request.id), str(self.request.id))
        # The work lasts until renewals have carried the lease 3 s on: past
        # the visibility timeout, about ten heartbeat intervals.
        wait_for(lambda: float(journal.read(ref).get("lease_end", 0)) > started + 3.0,
                 timeout=15, what="the heartbeat to renew the journal lease")
        return key

    with running_worker(app, concurrency=3):
        results = [long_write.delay(f"w{number}") for number in range(3)]
        assert [result.get(timeout=40) for result in results] == ["w0", "w1", "w2"]
        audit = AuditLog(app)
        for result in results:
            events = audit.events(result.id)
            assert [e["phase"] for e in events] == ["intent", "outcome"]
            assert DeadLetters(app).get(result.id) is None
            entry = journal.read(JournalRef(result.id, result.id))
            assert entry["state"] == "succeeded"
            # The intent leased 0.9 s (3 intervals); renewals carried it on.
            assert float(entry["lease_end"]) - float(events[0]["ts"]) > 3.0, entry
    assert [counter.value(f"w{number}") for number in range(3)] == [1, 1, 1]
