"""A write's leases, planned before its intent is recorded
(celery_tooleffect/worker/heartbeat.py: ``plan_leases``, ``heartbeat_interval``)."""

from __future__ import annotations

import dataclasses
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.settings import Settings, settings_for
from celery_tooleffect.worker.heartbeat import heartbeat_interval, plan_leases
from tests.unit.conftest import app_with

PROPERTIES = settings(max_examples=300, deadline=None, database=None)

REDIS = settings_for(app_with(broker_transport_options={"visibility_timeout": 60}))
RABBITMQ = settings_for(app_with(broker_url="amqp://g@h/te-unit",
                                 tooleffect_redis_url="redis://127.0.0.1:1/0",
                                 tooleffect_rabbitmq_consumer_timeout=600))


def test_on_redis_a_write_without_deadline_leans_on_the_visibility_timeout() -> None:
    before = time.time()
    plan = plan_leases(REDIS, None)
    assert before + 60 <= plan.journal_lease_end <= time.time() + 60
    assert plan.interval is None and plan.deadline_end is None  # nothing is extended
    assert plan.broker_lease is None and not plan.lease_with_intent


def test_on_rabbitmq_every_write_heartbeats_a_short_journal_lease() -> None:
    plan = plan_leases(RABBITMQ, None)
    assert plan.interval == 30.0  # 600 s / 6, at most 30 s
    assert plan.journal_lease_end <= time.time() + 3 * 30.0
    assert plan.deadline_end is None


def test_a_deadline_bounds_the_journal_lease_and_sets_the_heartbeat() -> None:
    before = time.time()
    plan = plan_leases(REDIS, 12.0)
    assert plan.interval == 2.0  # six per deadline
    assert plan.deadline_end is not None and before + 12 <= plan.deadline_end <= time.time() + 12
    assert plan.journal_lease_end <= plan.deadline_end
    short = plan_leases(REDIS, 1.0)
    assert short.interval == 0.5  # never below half a second
    assert short.journal_lease_end == short.deadline_end  # never past the deadline


def test_a_configured_interval_wins() -> None:
    configured = dataclasses.replace(REDIS, heartbeat_interval=0.25)
    assert heartbeat_interval(configured, None) == heartbeat_interval(configured, 9) == 0.25


@PROPERTIES
@given(redis=st.booleans(), held=st.floats(1, 10**5), deadline=st.none() | st.floats(0.01, 10**5))
def test_the_interval_is_six_per_bound_between_half_a_second_and_thirty(
        redis: bool, held: float, deadline: float | None) -> None:
    chosen: Settings = dataclasses.replace(REDIS if redis else RABBITMQ, visibility_timeout=held,
                                           rabbitmq_consumer_timeout=held)
    interval = heartbeat_interval(chosen, deadline)
    assert 0.5 <= interval <= 30.0
    bound = held if deadline is None else min(held, deadline)
    assert interval == min(max(bound / 6, 0.5), 30.0)
    if deadline is not None:
        plan = plan_leases(chosen, deadline)
        assert plan.interval == interval
        assert plan.deadline_end is not None
        assert plan.journal_lease_end <= plan.deadline_end
        # A heartbeat renews it before it lapses: three beats per lease at most.
        assert plan.journal_lease_end - time.time() <= 3 * interval + 0.01
