"""The one thread of a process that renews its heartbeats
(celery_tooleffect/worker/heartbeat.py: ``_Beats``): every heartbeat is renewed
when due, including one due before the time the thread already waits for,
while a heartbeat due later than that does not wake it. The journal here is a
stand-in that counts renewals: what is decided is when the thread renews."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from celery_tooleffect.store.journal import Journal, JournalRef
from celery_tooleffect.store.leases import Leases
from celery_tooleffect.testing import wait_for
from celery_tooleffect.worker.heartbeat import Heartbeat, _Beats


class CountingJournal:
    """Counts ``renew_lease`` per task id."""

    def __init__(self) -> None:
        self.renewed: dict[str, int] = {}
        self.lock = threading.Lock()

    def renew_lease(self, ref: JournalRef, *, token: str, lease_end: float) -> bool:
        with self.lock:
            self.renewed[ref.task_id] = self.renewed.get(ref.task_id, 0) + 1
        return True


def heartbeat(journal: CountingJournal, task_id: str, interval: float) -> Heartbeat:
    return Heartbeat(journal=cast(Journal, journal), ref=JournalRef("run", task_id), token="t",
                     leases=cast(Leases, None), broker_lease=None, deadline_end=None,
                     interval=interval, on_failure=lambda reason: None)


class CountingCondition(threading.Condition):
    """A condition that counts the wake-ups ``add`` asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_a_heartbeat_due_sooner_wakes_the_thread_one_due_later_does_not() -> None:
    beats = _Beats()
    condition = CountingCondition()
    beats._changed = condition
    journal = CountingJournal()
    slow = heartbeat(journal, "slow", 30.0)
    beats.add(slow, time.monotonic() + 30.0)
    # The thread now waits for the slow one; later ones do not wake it.
    wait_for(lambda: beats._waking_at is not None and beats._waking_at > 0, timeout=5,
             what="the thread to wait for the slow heartbeat")
    notified = condition.notified
    later = [heartbeat(journal, f"later{i}", 30.0) for i in range(20)]
    for number, each in enumerate(later):
        beats.add(each, time.monotonic() + 31.0 + number)
    assert condition.notified == notified
    for each in later:
        beats.remove(each)
    # One due sooner than the thread's wake-up is renewed on time, again and
    # again, while the slow one is not yet due.
    fast = heartbeat(journal, "fast", 0.05)
    beats.add(fast, time.monotonic() + 0.05)
    assert condition.notified == notified + 1
    wait_for(lambda: journal.renewed.get("fast", 0) >= 3, timeout=10,
             what="the fast heartbeat to be renewed three times")
    beats.remove(fast)
    beats.remove(slow)
    assert journal.renewed.get("slow", 0) == 0
    assert not any(name.startswith("later") for name in journal.renewed)


def test_the_first_heartbeat_wakes_an_idle_thread() -> None:
    beats = _Beats()
    journal = CountingJournal()
    first = heartbeat(journal, "first", 0.05)
    beats.add(first, time.monotonic() + 0.05)
    wait_for(lambda: journal.renewed.get("first", 0) >= 1, timeout=10, what="a renewal")
    beats.remove(first)
    # Idle again (nothing due): a new heartbeat is renewed too.
    wait_for(lambda: beats._waking_at is None, timeout=5, what="the thread to idle")
    second = heartbeat(journal, "second", 0.05)
    beats.add(second, time.monotonic() + 0.05)
    wait_for(lambda: journal.renewed.get("second", 0) >= 1, timeout=10, what="a renewal")
    beats.remove(second)
    thread: Any = beats._thread
    assert thread is not None and thread.daemon


def test_short_calls_one_after_another_do_not_wake_the_thread_each() -> None:
    """Calls that end before their first beat: the thread finds nothing due,
    lingers for an interval, and the next calls' heartbeats (due later) do
    not wake it; none is renewed."""
    beats = _Beats()
    condition = CountingCondition()
    beats._changed = condition
    journal = CountingJournal()
    for number in range(50):
        each = heartbeat(journal, f"short{number}", 5.0)
        beats.add(each, time.monotonic() + 5.0)
        # The call runs; the thread may look at what is due meanwhile.
        threading.Event().wait(0.002)
        beats.remove(each)
    assert condition.notified <= 2, condition.notified
    assert journal.renewed == {}
