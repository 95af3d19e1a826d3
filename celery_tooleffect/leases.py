"""Leases: how long a running write may keep its message and its journal entry.

Two leases guard a write with an ``operation_deadline``:

- the **broker lease**: on kombu's Redis transport a message is restored (and so
  delivered again) once its score in ``unacked_index`` is older than
  ``now - visibility_timeout``. Before the body starts, the score is raised so
  that the message stays put until the deadline; the write does not start if
  that fails. On transports without leases (RabbitMQ, memory) this is a no-op.
- the **journal lease**: ``lease_end`` of the journal entry says how long the
  owner is presumed alive. It is kept short and renewed by a heartbeat while
  the body runs, never past the deadline, so a worker that died is noticed
  soon after, and not only when the deadline passes.

The heartbeat runs in the process that runs the body (a prefork child, or the
worker of the threads pool), on one thread of that process that serves all its
running writes. It renews the journal first, then the broker, stops before the
outcome is recorded, and uses this process's own Redis clients (never one
inherited across a fork).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from .connections import redis_client
from .errors import StoreUnavailable
from .journal import Journal, JournalRef
from .lua import script
from .settings import Settings

logger = logging.getLogger(__name__)


class LeaseVerdict(str, enum.Enum):
    """The answer of one extension of a broker lease."""

    OK = "ok"
    BUSY = "busy"
    LOST = "lost"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class BrokerLease:
    """The lease of one delivered message on kombu's Redis transport."""

    tag: str
    index_key: str
    mutex_key: str
    visibility_timeout: float

    def score_for(self, lease_end: float) -> float:
        """The ``unacked_index`` score that keeps the message until ``lease_end``."""
        return lease_end - self.visibility_timeout


class Leases:
    """Extends broker leases of one app's messages."""

    #: How often, and how long apart, a BUSY answer is tried again.
    BUSY_RETRIES = 40
    BUSY_WAIT = 0.05

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        options = settings.broker_transport_options
        prefix = str(options.get("global_keyprefix", ""))
        # kombu's prefixed client does not prefix every command (ZADD in a
        # script, for one), so the prefix is added here.
        self._index_key = prefix + str(options.get("unacked_index_key", "unacked_index"))
        self._mutex_key = prefix + str(options.get("unacked_mutex_key", "unacked_mutex"))

    @property
    def supported(self) -> bool:
        """Whether the broker has leases to extend (kombu's Redis transport)."""
        return self.settings.broker_is_redis

    @property
    def client(self) -> redis.Redis:
        return redis_client(self.settings.broker_url, self.settings.socket_timeout)

    def broker_lease(self, properties: Mapping[str, Any] | None) -> BrokerLease | None:
        """The lease of the message with these properties; None without one."""
        tag = (properties or {}).get("delivery_tag")
        if not self.supported or tag is None:
            return None
        return BrokerLease(
            tag=str(tag),
            index_key=self._index_key,
            mutex_key=self._mutex_key,
            visibility_timeout=self.settings.visibility_timeout,
        )

    def extend_lease(self, lease: BrokerLease, lease_end: float) -> LeaseVerdict:
        """Keep the message until ``lease_end``; waits out a running restore sweep."""
        for _ in range(self.BUSY_RETRIES):
            try:
                answer = script("extend_lease")(
                    self.client,
                    [lease.mutex_key, lease.index_key],
                    [lease.tag, f"{lease.score_for(lease_end):.6f}"],
                )
            except redis.RedisError as exc:
                logger.warning("broker lease of %s not extended: %s", lease.tag, exc)
                return LeaseVerdict.UNAVAILABLE
            verdict = LeaseVerdict(answer.decode().lower() if isinstance(answer, bytes)
                                   else str(answer).lower())
            if verdict is not LeaseVerdict.BUSY:
                return verdict
            time.sleep(self.BUSY_WAIT)
        return LeaseVerdict.BUSY


@dataclass(frozen=True)
class LeasePlan:
    """The leases of one write attempt, decided before its intent is recorded."""

    #: When the journal presumes the owner dead unless a heartbeat renews it.
    journal_lease_end: float
    #: When the operation_deadline ends (None: the tool has no deadline).
    deadline_end: float | None = None
    #: Seconds between heartbeats (None: no heartbeat).
    interval: float | None = None
    #: The broker lease secured until the deadline (None: none to secure).
    broker_lease: BrokerLease | None = None


def heartbeat_interval(settings: Settings, deadline: float | None) -> float:
    """Seconds between heartbeats: six per deadline and per the time the broker
    lets a message stay unacknowledged (Redis: the visibility timeout; RabbitMQ:
    ``consumer_timeout``), between 0.5 and 30 s."""
    configured = settings.heartbeat_interval
    if configured:
        return float(configured)
    held = settings.visibility_timeout if settings.broker_is_redis else (
        settings.rabbitmq_consumer_timeout)
    bound = held if deadline is None else min(held, deadline)
    return min(max(bound / 6.0, 0.5), 30.0)


class Heartbeat:
    """Keeps a running write's leases alive until it stops (a context manager).

    Every ``interval`` it renews the journal lease to ``now + step`` and the
    broker lease to the same time, both capped at ``deadline_end`` (none: a
    write without a deadline on a broker without leases, which beats until
    its body returns). When a
    renewal fails it calls ``on_failure(reason)`` once and stops: ``journal_lost``
    (another attempt owns the entry), ``broker_lost`` (the message was
    restored), or ``store_unavailable``.

    The renewals are made by one thread per process (:class:`_Beats`) that
    serves every running heartbeat of that process: starting a thread for
    each tool call would cost more than most calls.
    """

    def __init__(
        self,
        *,
        journal: Journal,
        ref: JournalRef,
        token: str,
        leases: Leases,
        broker_lease: BrokerLease | None,
        deadline_end: float | None,
        interval: float,
        on_failure: Callable[[str], None],
    ) -> None:
        self.journal = journal
        self.ref = ref
        self.token = token
        self.leases = leases
        self.broker_lease = broker_lease
        self.deadline_end = deadline_end
        self.interval = interval
        self.step = 3 * interval
        self.on_failure = on_failure
        self.stopped = False

    def __enter__(self) -> Heartbeat:
        _beats().add(self, time.monotonic() + self.interval)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop beating; returns once no renewal of this heartbeat is in flight."""
        self.stopped = True
        _beats().remove(self)

    def beat(self) -> bool:
        """Renew once (called by the beats thread); whether to beat again."""
        lease_end = time.time() + self.step
        if self.deadline_end is not None:
            lease_end = min(lease_end, self.deadline_end)
        failure = self._renew(lease_end)
        if failure is not None:
            if not self.stopped:
                self.on_failure(failure)
            return False
        # At the deadline nothing more may be extended.
        return self.deadline_end is None or lease_end < self.deadline_end

    def _renew(self, lease_end: float) -> str | None:
        try:
            if not self.journal.renew_lease(self.ref, token=self.token, lease_end=lease_end):
                return "journal_lost"
        except StoreUnavailable:
            return "store_unavailable"
        if self.broker_lease is not None:
            verdict = self.leases.extend_lease(self.broker_lease, lease_end)
            if verdict is LeaseVerdict.LOST:
                return "broker_lost"
        return None


class _Beats:
    """The thread of one process that makes the renewals of its heartbeats, each
    when it is due, one at a time (a renewal is one or two short Redis calls)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        #: When each running heartbeat is due next (monotonic seconds).
        self._due: dict[Heartbeat, float] = {}
        self._renewing: Heartbeat | None = None
        self._thread: threading.Thread | None = None

    def add(self, heartbeat: Heartbeat, due: float) -> None:
        with self._changed:
            self._due[heartbeat] = due
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tooleffect-heartbeat",
                                                daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def remove(self, heartbeat: Heartbeat) -> None:
        with self._changed:
            self._due.pop(heartbeat, None)
            if threading.current_thread() is self._thread:
                return  # stopped from its own on_failure
            while self._renewing is heartbeat:
                self._changed.wait()

    def _run(self) -> None:
        while True:
            with self._changed:
                if not self._due:
                    self._changed.wait()
                    continue
                heartbeat, due = min(self._due.items(), key=lambda item: item[1])
                wait = due - time.monotonic()
                if wait > 0:
                    self._changed.wait(wait)
                    continue
                del self._due[heartbeat]
                self._renewing = heartbeat
            again = False
            try:
                again = heartbeat.beat()
            except Exception:  # the thread serves every heartbeat: it must not die
                logger.exception("heartbeat of %s failed", heartbeat.ref.task_id)
            finally:
                with self._changed:
                    self._renewing = None
                    if again and not heartbeat.stopped:
                        self._due[heartbeat] = time.monotonic() + heartbeat.interval
                    self._changed.notify_all()


_beats_of: dict[int, _Beats] = {}
_beats_lock = threading.Lock()


def _beats() -> _Beats:
    """This process's beats thread (a forked pool child makes its own)."""
    pid = os.getpid()
    beats = _beats_of.get(pid)
    if beats is None:
        with _beats_lock:
            beats = _beats_of.setdefault(pid, _Beats())
    return beats
