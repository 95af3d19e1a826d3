"""The tools a ``celery worker`` subprocess runs in the tests.

Configured from the environment by ``spawn_worker`` in conftest: TE_PREFIX
(every key of the test), TE_BROKER, TE_VT (visibility timeout), TE_STORE
(a store of its own: ``tooleffect_redis_url``; with TE_STORE_CLUSTER=1 a node
of a Redis Cluster, ``tooleffect_redis_cluster``), TE_RESULTS (a result
backend of its own), TE_COUNTERS (the Redis of the
side-effect counters and, on a RabbitMQ broker, of the results and, without
TE_STORE, of the store; default the broker, required on RabbitMQ: no server
is ever left to a default, tests/conftest.py ``refuse_defaults``),
TE_SOCKET_TIMEOUT, TE_HEARTBEAT (``tooleffect_heartbeat_interval``),
TE_QUEUE_TYPE and TE_DELIVERY_LIMIT (a RabbitMQ quorum queue),
TE_BROKER_HEARTBEAT (``broker_heartbeat``), TE_CONSUMER_TIMEOUT
(``tooleffect_rabbitmq_consumer_timeout``), TE_RECONCILE_TIMEOUT
(``tooleffect_reconcile_timeout``), TE_APPROVAL_TIMEOUT
(``tooleffect_approval_timeout``), TE_DLQ_WARN_COUNT and TE_DLQ_WARN_AGE
(``tooleffect_dead_letter_warn_count``, ``_warn_age``), TE_KILL_ON_PARK (the worker kills itself
once, when it has parked a call and before it acknowledges it). Each
body counts its executions, records the pid of the process running it, and
holds until released or its hold ends.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import redis
from celery import Celery

from celery_tooleffect import (
    Approval,
    Reconciliation,
    ToolEffect,
    ToolTask,
    approval_requested,
)
from celery_tooleffect.endpoints import is_redis_family
from tests.conftest import app_config, rabbitmq_queues, spawned_setting

PREFIX = spawned_setting("TE_PREFIX")
BROKER = spawned_setting("TE_BROKER")
#: The test's Redis: the broker (a redis:// one), else the one TE_COUNTERS names.
REDIS = BROKER if BROKER.startswith("redis") else spawned_setting("TE_COUNTERS")

app = Celery("tool_app")
app.conf.update(
    app_config(
        PREFIX,
        broker_url=BROKER,
        # Results on Redis whichever broker is used (Celery has no AMQP
        # backend); TE_RESULTS: a backend of their own (another database).
        result_backend=os.environ.get("TE_RESULTS") or REDIS,
        broker_transport_options={
            "global_keyprefix": PREFIX,
            "visibility_timeout": float(os.environ.get("TE_VT", "60")),
            # kombu 5.7 sweeps unacked messages every interval * throttle
            # seconds (100 s by default); the tests want it every second.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A worker SIGKILLed during a restore sweep leaves kombu's
            # unacked mutex held until it expires (300 s by default): no
            # message is restored meanwhile and every lease extension is
            # BUSY. The kill-heavy tests want it back within seconds.
            "unacked_mutex_expire": 10,
        },
        # On RabbitMQ the store is always named (else the package's default
        # would be 127.0.0.1:6379); on Redis it follows the broker.
        tooleffect_redis_url=os.environ.get("TE_STORE") or (
            None if is_redis_family(BROKER) else REDIS),
        # TE_STORE_CLUSTER=1: TE_STORE is a node of a Redis Cluster.
        tooleffect_redis_cluster=os.environ.get("TE_STORE_CLUSTER", "0") == "1",
        tooleffect_max_retries=int(os.environ.get("TE_MAX_RETRIES", "3")),
        tooleffect_socket_timeout=float(os.environ.get("TE_SOCKET_TIMEOUT", "2.0")),
        tooleffect_heartbeat_interval=float(os.environ.get("TE_HEARTBEAT") or 0) or None,
        tooleffect_rabbitmq_consumer_timeout=float(
            os.environ.get("TE_CONSUMER_TIMEOUT") or 1800),
        tooleffect_reconcile_timeout=float(os.environ.get("TE_RECONCILE_TIMEOUT") or 30),
        tooleffect_approval_timeout=float(os.environ.get("TE_APPROVAL_TIMEOUT") or 24 * 3600),
        # The thresholds of the unresolved dead letters' warnings.
        tooleffect_dead_letter_warn_count=int(os.environ.get("TE_DLQ_WARN_COUNT") or 100),
        tooleffect_dead_letter_warn_age=float(os.environ.get("TE_DLQ_WARN_AGE") or 86400),
        # Flower's /metrics behind Flower's authentication (the default) or not.
        tooleffect_flower_metrics_auth=os.environ.get("TE_FLOWER_METRICS_AUTH", "1") != "0",
        # AMQP heartbeats (seconds): how soon RabbitMQ notices a silent worker.
        broker_heartbeat=float(os.environ.get("TE_BROKER_HEARTBEAT") or 120),
        worker_hijack_root_logger=True,
        # TE_VOLATILE=0: refuse a store that can lose what it acknowledged.
        tooleffect_allow_volatile_store=os.environ.get("TE_VOLATILE", "1") == "1",
    )
)
app.conf.update(rabbitmq_queues(os.environ.get("TE_QUEUE_TYPE") or "classic",
                                int(os.environ.get("TE_DELIVERY_LIMIT") or 0)))
counters = redis.Redis.from_url(os.environ.get("TE_COUNTERS") or REDIS)


def hold_and_count(key: str, hold: float) -> str:
    """The side effect: count, say who runs it, then hold (first run only)."""
    runs = counters.incr(f"{PREFIX}count:{key}")
    counters.rpush(f"{PREFIX}started:{key}", os.getpid())
    if runs == 1:
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline and not counters.exists(f"{PREFIX}release:{key}"):
            time.sleep(0.02)
    return key


@app.task(base=ToolTask, name="tools.read")
def read(key: str, hold: float = 0.0) -> str:
    return hold_and_count(key, hold)


@app.task(base=ToolTask, name="tools.idempotent", effect=ToolEffect.IDEMPOTENT_WRITE)
def idempotent(key: str, hold: float = 0.0) -> str:
    return hold_and_count(key, hold)


@app.task(base=ToolTask, name="tools.write", effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def write(key: str, hold: float = 0.0) -> str:
    return hold_and_count(key, hold)


@app.task(base=ToolTask, name="tools.read_limited", time_limit=1)
def read_limited(key: str, hold: float = 0.0) -> str:
    return hold_and_count(key, hold)


@app.task(
    base=ToolTask, name="tools.write_limited", effect=ToolEffect.NON_IDEMPOTENT_WRITE,
    time_limit=1, operation_deadline=5,
)
def write_limited(key: str, hold: float = 0.0) -> str:
    return hold_and_count(key, hold)


@app.task(
    base=ToolTask, name="tools.write_deadline", effect=ToolEffect.NON_IDEMPOTENT_WRITE,
    operation_deadline=12,
)
def write_deadline(key: str, hold: float = 0.0) -> str:
    return hold_and_count(key, hold)


@app.task(base=ToolTask, name="tools.slow_idempotent", effect=ToolEffect.IDEMPOTENT_WRITE)
def slow_idempotent(key: str, hold: float = 0.0) -> str:
    """Counts, then holds on every run (not only the first) until released."""
    counters.incr(f"{PREFIX}count:{key}")
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not counters.exists(f"{PREFIX}release:{key}"):
        time.sleep(0.02)
    return key


@app.task(base=ToolTask, name="tools.write_offline", effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def write_offline(key: str, hold: float = 0.0) -> str:
    """Counts, then works ``hold`` seconds without touching any server (a
    partition may come and go meanwhile)."""
    counters.incr(f"{PREFIX}count:{key}")
    time.sleep(hold)
    return key


# -- a write that reconciles: a provider stand-in deduplicating by key -------------


def provider_charge(tool: ToolTask) -> str:
    """The provider's record of the charge made under this task's idempotency key."""
    return f"{PREFIX}provider:{tool.idempotency_key}"


def find_charge(self: ToolTask, key: str, hold: float = 0.0, when: str = "after",
                answer: str = "lookup") -> Reconciliation:
    """Asks the provider stand-in whether the charge was made (``answer``:
    ``lookup``, or ``raise``, ``unknown``, ``slow``, ``nonsense`` to misbehave;
    ``unknown_once``: unknown the first time, a lookup after)."""
    calls = counters.incr(f"{PREFIX}reconciled:{key}")
    if answer == "unknown_once" and calls == 1:
        answer = "unknown"
    if answer == "raise":
        raise LookupError("the provider's search is down")
    if answer == "unknown":
        return Reconciliation.unknown(evidence="the provider keeps no record of keys")
    if answer == "slow":  # a provider that does not answer until the test ends
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not counters.exists(f"{PREFIX}release:{key}"):
            time.sleep(0.05)
    if answer == "nonsense":
        return "yes"  # type: ignore[return-value]
    charge = counters.get(provider_charge(self))
    if charge is None:
        return Reconciliation.not_applied(evidence="no charge under this key")
    return Reconciliation.applied(charge.decode(), evidence=f"charge {charge.decode()}")


@app.task(base=ToolTask, bind=True, name="tools.charge",
          effect=ToolEffect.NON_IDEMPOTENT_WRITE, reconcile=find_charge)
def charge(self: ToolTask, key: str, hold: float = 0.0, when: str = "after",
           answer: str = "lookup") -> str:
    """Charges once per idempotency key; the first run holds ``hold`` seconds
    after (``when="after"``) or before (``"before"``) the charge."""
    runs = counters.incr(f"{PREFIX}count:{key}")
    counters.rpush(f"{PREFIX}started:{key}", os.getpid())
    if counters.exists(provider_charge(self)):
        # Run again although the charge was made: what reconcile must prevent.
        counters.incr(f"{PREFIX}after_charge:{key}")
    charge_id = f"ch-{key}-{runs}"

    def make_charge() -> None:
        if counters.set(provider_charge(self), charge_id, nx=True):
            counters.incr(f"{PREFIX}charges:{key}")

    if when == "after":
        make_charge()
    if runs == 1:
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline and not counters.exists(f"{PREFIX}release:{key}"):
            time.sleep(0.02)
    if when == "before":
        make_charge()
    return str(counters.get(provider_charge(self)).decode())


# -- calls a person approves -----------------------------------------------------------


@app.task(base=ToolTask, name="tools.approved_write", effect=ToolEffect.NON_IDEMPOTENT_WRITE,
          requires_approval=True)
def approved_write(key: str, hold: float = 0.0) -> str:
    """Every call waits for a person's approval."""
    return hold_and_count(key, hold)


def large_refunds(self: ToolTask, key: str, amount: int) -> bool:
    """The approval policy of ``tools.refund``: refunds above 100 only."""
    return amount > 100


@app.task(base=ToolTask, name="tools.refund", effect=ToolEffect.IDEMPOTENT_WRITE,
          requires_approval=large_refunds)
def refund(key: str, amount: int) -> int:
    hold_and_count(key, 0.0)
    return amount


def masked_card(self: ToolTask, key: str, card: str, amount: int) -> dict[str, str]:
    """What approvers see of ``tools.pay``: the card's last four digits only."""
    return {"card": f"**** **** **** {card[-4:]}", "amount": f"{amount / 100:.2f}"}


@app.task(base=ToolTask, name="tools.pay", effect=ToolEffect.NON_IDEMPOTENT_WRITE,
          requires_approval=True, approval_view=masked_card)
def pay(key: str, card: str, amount: int) -> str:
    """Charge a card; a person approves each charge, seeing the card masked."""
    return hold_and_count(key, 0.0)


def broken_view(self: ToolTask, key: str) -> dict[str, str]:
    raise RuntimeError("the masking service is down")


@app.task(base=ToolTask, name="tools.pay_broken_view", effect=ToolEffect.NON_IDEMPOTENT_WRITE,
          requires_approval=True, approval_view=broken_view)
def pay_broken_view(key: str) -> str:
    """A charge whose approval view raises: its arguments are hidden, it can be decided."""
    return hold_and_count(key, 0.0)


@app.task(name="tools.plain", acks_late=True)
def plain(key: str, hold: float = 0.0) -> str:
    """A plain Celery task (no ToolTask), late acknowledgement: the baseline."""
    return hold_and_count(key, hold)


@app.task(name="tools.errback")
def errback(request: Any, exc: BaseException, traceback: Any) -> None:
    """A ``link_error`` callback (Celery calls it with the failed request)."""
    counters.rpush(f"{PREFIX}errbacks", f"{request.id} {type(exc).__name__}")


@approval_requested.connect
def on_parked(sender: Any, approval: Approval, **kwargs: Any) -> None:
    counters.rpush(f"{PREFIX}parked", approval.task_id)
    if os.environ.get("TE_KILL_ON_PARK") and counters.incr(f"{PREFIX}killed_on_park") == 1:
        # The record is stored and the message not yet acknowledged.
        os.killpg(os.getpgid(0), signal.SIGKILL)
