"""The heartbeat of a running write, and the lease plan it keeps.

The heartbeat runs in the process that runs the body (a prefork child, or the
worker of the threads pool), on one thread of that process that serves all its
running writes. It renews the journal first, then the broker, stops before the
outcome is recorded, and uses this process's own Redis clients (never one
inherited across a fork).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StoreUnavailable
from ..settings import Settings
from ..store.journal import Journal, JournalRef
from ..store.leases import BrokerLease, Leases, LeaseVerdict

logger = logging.getLogger(__name__)


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
    #: The broker is on the store's Redis server (any database):
    #: ``broker_lease`` is secured by the intent's own script, not before it.
    lease_with_intent: bool = False


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


def plan_leases(settings: Settings, deadline: float | None) -> LeasePlan:
    """The leases of a write that starts now (the broker lease not yet secured).

    On Redis, a write without an ``operation_deadline`` has the visibility
    timeout as its journal lease and nothing is extended: the message comes
    back after it, as with plain Celery. A broker without a visibility
    timeout (RabbitMQ) gives a message back as soon as its holder's channel
    closes, so there every write heartbeats a short journal lease (three
    intervals), with or without a deadline: a redelivery after its owner
    died is settled within one journal lease. With a deadline, the journal
    lease is three intervals, never past the deadline.
    """
    now = time.time()
    if not deadline:
        if settings.broker_is_redis:
            return LeasePlan(journal_lease_end=now + settings.visibility_timeout)
        interval = heartbeat_interval(settings, None)
        return LeasePlan(journal_lease_end=now + 3 * interval, interval=interval)
    deadline_end = now + float(deadline)
    interval = heartbeat_interval(settings, float(deadline))
    return LeasePlan(
        journal_lease_end=min(now + 3 * interval, deadline_end),
        deadline_end=deadline_end,
        interval=interval,
    )


class Heartbeat:
    """Keeps a running write's leases alive until it stops (a context manager).

    Every ``interval`` it renews the journal lease to ``now + step`` and the
    broker lease to the same time, both capped at ``deadline_end`` (none: a
    write without a deadline on a broker without leases, which beats until
    its body returns). When a renewal succeeds it calls ``on_renewed()``
    (when given: the tool span's event and metric); when one fails it calls
    ``on_failure(reason)`` once: ``journal_lost`` (another attempt owns the
    entry) or ``store_unavailable``, and it stops; ``broker_lost`` (the
    message was restored: kombu's sweep read its score before a raise), and
    only the broker lease stops: the journal lease is renewed on, so the
    restored copy finds this attempt alive and waits for it (it is deferred,
    then acknowledged without running once the outcome is recorded), rather
    than finding the lease lapsed and dead-lettering a write that succeeds.

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
        on_renewed: Callable[[], None] | None = None,
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
        self.on_renewed = on_renewed
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
        if failure == "broker_lost":
            self.broker_lease = None  # nothing left to extend; the journal beats on
            if not self.stopped:
                self.on_failure(failure)
        elif failure is not None:
            if not self.stopped:
                self.on_failure(failure)
            return False
        if self.on_renewed is not None:
            self.on_renewed()
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
    when it is due, one at a time (a renewal is one or two short Redis calls).

    A heartbeat added is due one interval later than every one added before
    it (the intervals of a process's tools are alike), so the thread is woken
    only when the new one is due before the time it already waits for: a
    write's start does not cost a switch to the thread and back. Short calls
    end before their first beat, so the thread often finds nothing due; it
    then lingers for the shortest interval it has seen (a heartbeat added
    meanwhile is due no sooner, and does not wake it), and only after one
    such wait with nothing due does it sleep until the next heartbeat."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        #: When each running heartbeat is due next (monotonic seconds).
        self._due: dict[Heartbeat, float] = {}
        self._renewing: Heartbeat | None = None
        self._thread: threading.Thread | None = None
        #: When the thread wakes by itself (monotonic seconds): None while it
        #: waits for a heartbeat, -inf while it renews (it looks at what is
        #: due once it is done).
        self._waking_at: float | None = None
        #: The shortest interval of the heartbeats added (seconds).
        self._shortest = float("inf")
        #: The thread's last wait ended with nothing due.
        self._lingered = False

    def add(self, heartbeat: Heartbeat, due: float) -> None:
        with self._changed:
            self._due[heartbeat] = due
            self._shortest = min(self._shortest, due - time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tooleffect-heartbeat",
                                                daemon=True)
                self._thread.start()
            if self._waking_at is None or due < self._waking_at:
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
                    if self._lingered or self._shortest == float("inf"):
                        self._waking_at = None
                        self._changed.wait()
                    else:
                        self._lingered = True
                        self._waking_at = time.monotonic() + self._shortest
                        self._changed.wait(self._shortest)
                    continue
                self._lingered = False
                heartbeat, due = min(self._due.items(), key=lambda item: item[1])
                wait = due - time.monotonic()
                if wait > 0:
                    self._waking_at = due
                    self._changed.wait(wait)
                    continue
                del self._due[heartbeat]
                self._renewing = heartbeat
                self._waking_at = float("-inf")
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
