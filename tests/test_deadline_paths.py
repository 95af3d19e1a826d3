"""Every way a deadline write's message leaves the queue (issue 28).

A write with an ``operation_deadline`` is the one call that touches kombu's
keys itself: its intent raises the message's ``unacked_index`` score
(``begin_attempt.lua``, ``ZADD XX GT``), its heartbeat raises it again
(``extend_lease.lua``), and a delivery whose score is gone (``lease_lost``)
gives up, trusting the message's other copy. Each test here forces one path by
hand, on a redis-server of its own with real ``celery worker`` processes of
``tests/apps/tool_app.py``, and says where the message ends (queued, held
unacknowledged, a dead letter, SUCCESS) and how often the body ran.

The states are forced so:

- a copy *held* in a worker's memory: a call with a countdown (Celery holds it
  unacknowledged until its ETA, its visibility timeout running) behind a
  long call that keeps the only pool process busy;
- kombu's restore sweep: kombu's own ``QoS.restore_visible`` /
  ``restore_by_tag`` on a connection of the test's, after the worker was told
  to stop consuming (``cancel_consumer``: kombu sweeps only from a channel
  that consumes, so the test's sweep is then the only one);
- a sweep in progress: kombu's ``unacked_mutex`` held by the test;
- "a worker that took the message and died": the test's own fetch, never
  acknowledged: kombu's ``BRPOP`` (nothing recorded: kombu's window) or the
  atomic fetch's ``fetch.lua`` (recorded in ``unacked``);
- a worker's main process that has not yet ended a delivery its pool
  process decided: the main process stopped (SIGSTOP) meanwhile;
- a SIGKILL at a boundary of the attempt: ``TOOLEFFECT_CRASH_AT``;
- a store or a broker that refuses writes (``maxmemory 1``).

Where kombu's fetch can lose the message, the test runs with both fetches:
the atomic fetch never loses it; kombu's fetch loses it exactly as asserted.
A test not parametrized by fetch runs with the suite's
(``TOOLEFFECT_TEST_FETCH``) and depends on neither.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection  # type: ignore[attr-defined]
from kombu.transport import redis as kombu_redis
from redis.client import Pipeline

from celery_tooleffect import AuditLog, DeadLetters
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.lua import script
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import (
    RedisServer,
    WorkerProcess,
    redis_server,
    start_celery_worker,
    wait_for,
)
from tests.support import TEST_FETCH, app_config

pytestmark = pytest.mark.timeout(240)

TESTS = Path(__file__).parent
#: The visibility timeout of every test here: kombu restores a held message
#: this long after it was fetched (the deadlines of tool_app are longer).
VT = 2.0
#: The lists kombu's BRPOP (and the atomic fetch) take queue ``tools`` from,
#: in their order: kombu's default priority steps 0, 3, 6, 9.
LISTS = ("tools", "tools\x06\x163", "tools\x06\x166", "tools\x06\x169")
FETCHES = ("kombu", "atomic")


def task_id_of(item: bytes | str) -> str:
    """The task id of a kombu envelope (Celery's message protocol 2)."""
    return str(json.loads(item)["headers"]["id"])


@dataclass
class Scene:
    """A redis-server of the test's own (broker, results, store, counters),
    workers of tool_app on it with ``fetch``, and an app that sends calls."""

    server: RedisServer
    fetch: str
    logs: Path
    #: A separate store (journal, audit, dead letters); None: the broker's Redis.
    store: RedisServer | None = None
    prefix: str = field(default_factory=lambda: f"dl{uuid.uuid4().hex[:6]}:")
    workers: list[WorkerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = self.server.client()
        self.app = Celery("deadline-paths", set_as_current=False)
        self.app.conf.update(app_config(
            self.prefix, broker_url=self.server.url, result_backend=self.server.url,
            broker_transport_options=self.transport_options(),
            tooleffect_redis_url=self.store.url if self.store else None,
            tooleffect_atomic_fetch=self.fetch == "atomic"))

    def transport_options(self) -> dict[str, Any]:
        # As tests/apps/tool_app.py sets them.
        return {"global_keyprefix": self.prefix, "visibility_timeout": VT,
                "unacked_restore_interval": 1, "unacked_restore_throttle": 1,
                "unacked_mutex_expire": 10}

    # -- workers and calls ----------------------------------------------------

    def worker(self, concurrency: int = 1, **env: str) -> WorkerProcess:
        """A started ``celery worker`` of tool_app (prefork) with this scene's fetch."""
        worker = start_celery_worker(
            "tests.apps.tool_app", self.logs / f"worker-{len(self.workers)}.log",
            concurrency=concurrency, name=f"dl{len(self.workers)}", root=TESTS.parent,
            ready_timeout=60,
            env={"TE_PREFIX": self.prefix, "TE_BROKER": self.server.url,
                 "TE_COUNTERS": self.server.url, "TE_VT": str(VT),
                 "TE_STORE": self.store.url if self.store else "",
                 "TOOLEFFECT_TEST_FETCH": self.fetch, **env})
        self.workers.append(worker)
        return worker

    def send(self, tool: str, key: str, hold: float = 0.0, **options: Any) -> Any:
        return self.app.send_task(tool, args=[key, hold], queue="tools", **options)

    def runs(self, key: str) -> int:
        """How often the body ran for ``key`` (tool_app counts it)."""
        return int(self.client.get(f"{self.prefix}count:{key}") or 0)

    def release(self, key: str) -> None:
        """Let a holding body return."""
        self.client.set(f"{self.prefix}release:{key}", 1)

    def stop_consuming(self, worker: WorkerProcess) -> None:
        """The worker stops fetching from ``tools`` (and so stops sweeping:
        kombu's ``maybe_restore_messages`` sweeps only from a channel that
        consumes a queue); what it holds stays held and runs."""
        replies = self.app.control.cancel_consumer("tools", destination=[worker.name],
                                                   reply=True, timeout=10)
        assert replies and "ok" in replies[0][worker.name], replies

    def consume_again(self, worker: WorkerProcess) -> None:
        replies = self.app.control.add_consumer("tools", destination=[worker.name],
                                                reply=True, timeout=10)
        assert replies and "ok" in replies[0][worker.name], replies

    # -- the store ---------------------------------------------------------------

    def events(self, task_id: str) -> list[tuple[str, str]]:
        """(phase, status) of the task's audit events, in order."""
        return [(event["phase"], event["status"])
                for event in AuditLog(self.app).events(task_id)]

    def phases(self, task_id: str) -> list[str]:
        return [phase for phase, _ in self.events(task_id)]

    def journal(self, task_id: str) -> dict[str, str]:
        return runtime_for(self.app).journal.read(JournalRef(task_id, task_id))

    def dead_letter(self, task_id: str) -> Any:
        return DeadLetters(self.app).get(task_id)

    # -- kombu's keys ------------------------------------------------------------

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def queued(self, task_id: str) -> int:
        """How many copies of the task's message wait in queue ``tools``."""
        return sum(task_id_of(item) == task_id for name in LISTS
                   for item in self.client.lrange(self.key(name), 0, -1))

    def tag_of(self, task_id: str) -> str | None:
        """The delivery tag the task's message is held unacknowledged under."""
        for tag, record in self.client.hgetall(self.key("unacked")).items():
            if task_id_of(json.dumps(json.loads(record)[0])) == task_id:
                return tag.decode() if isinstance(tag, bytes) else str(tag)
        return None

    def score(self, tag: str) -> float | None:
        score = self.client.zscore(self.key("unacked_index"), tag)
        return None if score is None else float(score)

    def where(self, task_id: str) -> dict[str, int]:
        """Where the task's message is on the broker: queued copies, and held
        unacknowledged (a record in ``unacked``)."""
        return {"queued": self.queued(task_id), "unacked": int(self.tag_of(task_id) is not None)}

    def gone(self, task_id: str) -> bool:
        """Whether no copy of the message is queued or held unacknowledged."""
        return self.where(task_id) == {"queued": 0, "unacked": 0}

    @contextmanager
    def kombu(self) -> Iterator[Any]:
        """A channel of kombu's own Redis transport on the broker (its QoS is
        kombu's restore code)."""
        with Connection(  # type: ignore[no-untyped-call]
                self.server.url, transport=kombu_redis.Transport,
                transport_options=self.transport_options()) as connection:
            yield connection.default_channel

    def sweep(self) -> None:
        """kombu's restore sweep, as a worker's timer runs it: under kombu's
        ``unacked_mutex``, every message whose score is older than
        now - visibility_timeout goes back to its queue."""
        with self.kombu() as channel:
            channel.qos.restore_visible(num=100, interval=1)

    def sweep_until_restored(self, task_id: str) -> None:
        """Run kombu's sweep until it restored the held copy of ``task_id``
        (once its visibility timeout passed): one copy queued, none held."""

        def restored() -> bool:
            self.sweep()
            return self.where(task_id) == {"queued": 1, "unacked": 0}

        wait_for(restored, timeout=20, what=f"kombu's sweep to restore {task_id}")

    def restore(self, tag: str) -> None:
        """kombu's ``QoS.restore_by_tag``: what a sweep does with each tag it found."""
        with self.kombu() as channel:
            channel.qos.restore_by_tag(tag)

    def hold_mutex(self) -> None:
        """Hold kombu's ``unacked_mutex``, as a restore sweep does while it runs."""
        assert self.client.set(self.key("unacked_mutex"), "test-sweep", nx=True, px=60_000)

    def drop_mutex(self) -> None:
        self.client.delete(self.key("unacked_mutex"))

    def take_as_dying_worker_recording(self) -> bytes:
        """Take the next message off ``tools`` and record it unacknowledged, as
        any worker that took it does (kombu: BRPOP, then QoS.append; the
        atomic fetch: both in one step), here by ``fetch.lua``; never
        acknowledge it."""
        keys = [self.key(name) for name in LISTS]
        reply = script("fetch")(
            self.client, [self.key("unacked"), self.key("unacked_index"), *keys],
            [repr(time.time()), *(["tools"] * len(keys))])
        assert reply is not None and reply[3] == b"kombu", reply
        item: bytes = reply[1]
        return item

    def take_as_dying_worker(self) -> bytes:
        """Take the next message off ``tools`` as a worker does, and die: never
        acknowledge it. kombu's fetch: ``BRPOP`` (the message is recorded only
        by a second command, ``QoS.append``, which a worker killed in between
        never sends). The atomic fetch: ``fetch.lua`` (recorded and popped in
        one step)."""
        keys = [self.key(name) for name in LISTS]
        if self.fetch == "kombu":
            taken = self.client.brpop(keys, timeout=1)
            assert taken is not None, "nothing queued"
            popped = taken[1]
            return popped if isinstance(popped, bytes) else popped.encode()
        return self.take_as_dying_worker_recording()

    def log_lines(self, task_id: str) -> list[str]:
        return [line for worker in self.workers for line in worker.output().splitlines()
                if task_id in line]


def said(scene: Scene, task_id: str, text: str) -> bool:
    """Whether a worker's log line names ``task_id`` and says ``text``."""
    return any(text in line for line in scene.log_lines(task_id))


@pytest.fixture
def scene(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Scene]:
    """A scene with the fetch of the test's parameter (``indirect``), else the
    suite's (``TOOLEFFECT_TEST_FETCH``)."""
    fetch = getattr(request, "param", TEST_FETCH)
    with redis_server() as server:
        made = Scene(server, fetch, tmp_path)
        try:
            yield made
        finally:
            for worker in made.workers:
                worker.kill()


@pytest.fixture
def scene_with_store(tmp_path: Path) -> Iterator[Scene]:
    """A scene whose journal and audit store is a redis-server apart from the
    broker (so the broker lease is extended by a call of its own,
    ``extend_lease.lua``, before the intent); the test may make it refuse writes."""
    with redis_server() as server, redis_server() as store:
        made = Scene(server, TEST_FETCH, tmp_path, store=store)
        try:
            yield made
        finally:
            for worker in made.workers:
                worker.kill()


def hold_a_copy(scene: Scene, tool: str = "tools.write_deadline") -> tuple[Any, str, str]:
    """A call of ``tool`` held unacknowledged in a worker's memory, not begun:
    sent with a countdown (Celery holds it until its ETA) just before a long
    deadline write that keeps the worker's only pool process busy (its own
    lease raised well past the test). Returns the held call, its key and the
    blocker's key; the worker no longer consumes (the test sweeps)."""
    worker = scene.worker(concurrency=1)
    key, blocker = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    held = scene.send(tool, key, countdown=4)
    scene.send("tools.write_deadline", blocker, hold=60)
    wait_for(lambda: scene.runs(blocker) == 1, what="the blocker to run")
    assert scene.phases(held.id) == [], "the held call began before the blocker ran"
    assert scene.tag_of(held.id) is not None
    scene.stop_consuming(worker)
    return held, key, blocker


# -- 1. a held copy restored, its restored copy taken by a worker that dies ---------


@pytest.mark.parametrize("scene", FETCHES, indirect=True)
@pytest.mark.parametrize("taken", ["before_it_begins", "after_it_gave_up"])
def test_a_held_deadline_write_whose_restored_copy_is_taken_by_a_dying_worker(
    scene: Scene, taken: str,
) -> None:
    """A deadline write held in a worker's memory past the visibility timeout
    is restored by kombu's sweep; its restored copy is then taken by a worker
    that dies, before the held copy begins or after it gave up (its score is
    gone: ``lease_lost``, "its other copy runs").

    kombu's fetch: lost. The dying worker's BRPOP recorded nothing, the held
    copy gives up without running: no journal entry, the body never ran, no
    copy queued or unacknowledged, only the held copy's ``lease_refused``
    audit event and log lines. The atomic fetch: the dying worker's fetch
    recorded the copy, so the held copy begins on that record (secures it
    and runs), or kombu restores it again and it runs: SUCCESS, once."""
    held, key, blocker = hold_a_copy(scene)
    scene.sweep_until_restored(held.id)
    if taken == "before_it_begins":
        assert task_id_of(scene.take_as_dying_worker()) == held.id
        scene.release(blocker)
    else:
        scene.release(blocker)
        wait_for(lambda: scene.events(held.id) == [("lease_refused", "lost")],
                 what="the held copy to give up")
        assert task_id_of(scene.take_as_dying_worker()) == held.id

    if scene.fetch == "kombu":
        gave_up = f"{held.id}] not acknowledged"
        wait_for(lambda: any(gave_up in line for line in scene.log_lines(held.id)),
                 what="the held copy's delivery to end")
        assert scene.events(held.id) == [("lease_refused", "lost")]
        assert said(scene, held.id, "broker lease lost before the write began (audited)")
        assert scene.journal(held.id) == {}
        assert scene.gone(held.id)
        assert scene.runs(key) == 0
        assert held.state == "PENDING"
        return
    scene.consume_again(scene.workers[0])
    assert held.get(timeout=30) == key
    wait_for(lambda: scene.gone(held.id), what="the message to be acknowledged")
    assert scene.runs(key) == 1
    expected = ["intent", "outcome"] if taken == "before_it_begins" else [
        "lease_refused", "intent", "outcome"]
    assert scene.phases(held.id) == expected


@pytest.mark.parametrize("scene", ["kombu"], indirect=True)
def test_without_a_deadline_the_held_copy_runs_when_its_restored_copy_is_lost(
    scene: Scene,
) -> None:
    """The same path for a write without a deadline (kombu's fetch): the
    restored copy is lost in kombu's window, but the held copy checks no
    broker lease, begins and runs. This is why the path loses deadline writes
    only."""
    held, key, blocker = hold_a_copy(scene, tool="tools.write")
    scene.sweep_until_restored(held.id)
    assert task_id_of(scene.take_as_dying_worker()) == held.id
    scene.release(blocker)
    assert held.get(timeout=30) == key
    assert scene.runs(key) == 1
    assert scene.phases(held.id) == ["intent", "outcome"]
    assert scene.gone(held.id)


# -- 2. kombu's sweep racing the lease raise ----------------------------------------


def test_a_write_restored_while_its_lease_is_busy_gives_up_and_its_restored_copy_runs(
    scene: Scene,
) -> None:
    """A sweep holds kombu's mutex while a deadline write begins: the intent's
    script answers BUSY (tried again for up to 2 s), the sweep restores the
    message meanwhile, then lets go of the mutex. The delivery finds its score
    gone: ``lease_lost``, nothing recorded but its ``lease_refused`` event; the
    restored copy, queued, is taken by the worker and runs once."""
    scene.worker(concurrency=1)
    scene.hold_mutex()
    key = uuid.uuid4().hex[:8]
    call = scene.send("tools.write_deadline", key)
    tag = wait_for(lambda: scene.tag_of(call.id), what="the worker to take the call")
    assert tag is not None
    scene.restore(tag)
    assert scene.where(call.id) == {"queued": 1, "unacked": 0}
    scene.drop_mutex()
    assert call.get(timeout=30) == key
    wait_for(lambda: scene.gone(call.id), what="the message to be acknowledged")
    assert scene.runs(key) == 1
    assert scene.events(call.id) == [("lease_refused", "lost"), ("intent", "started"),
                                     ("outcome", "succeeded")]
    # The delivery that gave up says so in the worker's log, by task id.
    assert said(scene, call.id, "broker lease lost before the write began (audited)")
    assert said(scene, call.id, "not acknowledged")


def test_a_write_whose_lease_stays_busy_is_retried_and_runs_once(scene: Scene) -> None:
    """A sweep holds kombu's mutex for longer than a delivery waits (2 s):
    ``lease_busy``, the write is not run by this delivery and is retried as
    CONNECTION (a new message published before this one is acknowledged); the
    retry runs once the mutex is gone."""
    scene.worker(concurrency=1)
    scene.hold_mutex()
    key = uuid.uuid4().hex[:8]
    call = scene.send("tools.write_deadline", key)
    wait_for(lambda: ("lease_refused", "busy") in scene.events(call.id),
             what="the delivery to give up waiting")
    scene.drop_mutex()
    assert call.get(timeout=30) == key
    wait_for(lambda: scene.gone(call.id), what="the message to be acknowledged")
    assert scene.runs(key) == 1
    events = scene.events(call.id)
    assert events[-2:] == [("intent", "started"), ("outcome", "succeeded")]
    assert set(events[:-2]) == {("lease_refused", "busy")}
    assert said(scene, call.id, "broker lease busy before the write began (audited)")


# -- 3. a lease_lost delivery ends while its restored copy is recorded ------------


def seen_by_redis(scene: Scene, *words: str) -> threading.Event:
    """An event set once a client sends the broker's Redis a command holding
    every one of ``words`` (MONITOR, on a thread of its own that ends with
    the command or with the server)."""
    seen = threading.Event()
    monitoring = threading.Event()

    def watch() -> None:
        client = scene.server.client(socket_timeout=None)
        with contextlib.suppress(redis.RedisError, OSError), \
                client.monitor() as monitor:  # type: ignore[no-untyped-call]
            monitoring.set()
            while not seen.is_set():
                command = monitor.next_command()["command"]
                if all(word in command for word in words):
                    seen.set()

    threading.Thread(target=watch, daemon=True).start()
    assert monitoring.wait(10)
    return seen


def test_a_delivery_that_lost_its_lease_never_acknowledges_the_copy_recorded_since(
    scene: Scene,
) -> None:
    """A delivery whose lease is lost ends in the worker's main process a
    moment after its pool process decided it: meanwhile the restored copy may
    be taken and recorded under the same delivery tag (another worker, by
    kombu's BRPOP and QoS.append or by the atomic fetch). The ending forgets
    the message locally and acknowledges nothing on the broker, so that
    record stays; its worker dying, kombu restores the copy, which runs.

    The main process is stopped (SIGSTOP) while its pool process begins the
    write, so its bookkeeping comes after the copy is recorded, always."""
    worker = scene.worker(concurrency=1)
    scene.hold_mutex()
    key = uuid.uuid4().hex[:8]
    begins = seen_by_redis(scene, script("begin_attempt").sha)
    call = scene.send("tools.write_deadline", key)
    assert begins.wait(20), "the pool process never began the write"
    os.kill(worker.process.pid, signal.SIGSTOP)  # the main process only
    try:
        tag = scene.tag_of(call.id)
        assert tag is not None
        scene.restore(tag)
        scene.drop_mutex()
        wait_for(lambda: scene.events(call.id) == [("lease_refused", "lost")],
                 what="the pool process to find its lease lost")
        assert task_id_of(scene.take_as_dying_worker_recording()) == call.id
        recorded = scene.score(tag)
        assert recorded is not None
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
    wait_for(lambda: said(scene, call.id, "not acknowledged"),
             what="the main process to end the delivery")
    assert scene.score(tag) == recorded  # the copy's record, untouched
    assert call.get(timeout=30) == key  # restored from that record, run
    wait_for(lambda: scene.gone(call.id), what="no copy left")
    assert scene.runs(key) == 1
    assert scene.phases(call.id) == ["lease_refused", "intent", "outcome"]


# -- 4. a restore that races the heartbeat of a running write ------------------------


def heartbeat_inside_the_restore(scene: Scene, tag: str, lease_end: float,
                                 monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the next kombu restore transaction of this process run the
    heartbeat's raise (``extend_lease.lua``) between its WATCH of ``unacked``
    (and its HGET) and its MULTI. kombu watches the hash only, so the raise
    does not abort the restore. Returns the answers of the raises (one)."""
    answers: list[str] = []
    multi = Pipeline.multi

    def raise_then_multi(pipe: Pipeline) -> None:
        if not answers:
            answer = script("extend_lease")(
                scene.client, [scene.key("unacked_mutex"), scene.key("unacked_index")],
                [tag, f"{lease_end - VT:.6f}"])
            answers.append(answer.decode() if isinstance(answer, bytes) else str(answer))
        multi(pipe)

    monkeypatch.setattr(Pipeline, "multi", raise_then_multi)
    return answers


@pytest.mark.parametrize("scene", FETCHES, indirect=True)
@pytest.mark.parametrize("copy", ["taken_by_a_worker", "taken_by_a_dying_worker"])
def test_a_restore_racing_the_heartbeat_of_a_running_write_loses_nothing(
    scene: Scene, copy: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A running deadline write (its lease raised, its heartbeat beating) is
    restored anyway, by a sweep that read its score before the raise and whose
    mutex expired meanwhile (kombu's ``restore_by_tag`` checks no score), with
    a heartbeat raise landing inside kombu's restore transaction.

    The restore goes through (the raise answered OK, then the record was
    removed), the restored copy is queued, and the heartbeat answers LOST at
    its next beat. Taken by a worker, the copy finds the running owner and is
    deferred for as long as the owner runs (at LOST the heartbeat stops only
    the broker lease; the journal lease goes on), then is acknowledged
    without running once the owner's outcome is recorded: SUCCESS, no dead
    letter. Taken by a dying worker,
    the running write succeeds; with the atomic fetch its outcome's script
    acknowledges the dead worker's record. Either way the body ran once and
    the message has an ending."""
    # Concurrency 2: a free pool process, so the worker takes the restored
    # copy. Concurrency 1: the worker, busy with the write, takes nothing (its
    # one prefetched message is the write), so the test's dying worker does.
    scene.worker(concurrency=2 if copy == "taken_by_a_worker" else 1)
    key = uuid.uuid4().hex[:8]
    call = scene.send("tools.write_deadline", key, hold=60)
    wait_for(lambda: scene.runs(key) == 1, what="the write to run")
    tag = scene.tag_of(call.id)
    assert tag is not None
    lease_until = float(AuditLog(scene.app).events(call.id)[0]["lease_until"])
    assert scene.score(tag) == pytest.approx(lease_until - VT, abs=0.01)  # held to the deadline
    answers = heartbeat_inside_the_restore(scene, tag, lease_until, monkeypatch)
    scene.restore(tag)
    monkeypatch.undo()
    assert answers == ["OK"]
    # Restored: the score raised to the deadline is gone (the worker may hold
    # the restored copy already, recorded under the same tag, scored now).
    after = scene.score(tag)
    assert after is None or after < time.time()

    if copy == "taken_by_a_worker":
        wait_for(lambda: ("lease_extension_failed", "broker_lost") in scene.events(call.id),
                 what="the heartbeat to find its lease lost")
        # The restored copy found the owner alive and was deferred; the owner's
        # journal lease is still renewed, so it is deferred again, never
        # dead-lettered, for as long as the write runs.
        wait_for(lambda: "deferred" in scene.phases(call.id), timeout=30,
                 what="the restored copy to be deferred to the running owner")
        journal_lease = float(scene.journal(call.id)["lease_end"])
        wait_for(lambda: float(scene.journal(call.id)["lease_end"]) > journal_lease,
                 timeout=10, what="the journal lease to be renewed after LOST")
        assert scene.dead_letter(call.id) is None
        scene.release(key)
        assert call.get(timeout=30) == key
        # The copy, delivered after the outcome, is acknowledged without running.
        wait_for(lambda: "duplicate_ignored" in scene.phases(call.id), timeout=60,
                 what="the deferred copy to come back and be acknowledged")
        assert scene.dead_letter(call.id) is None
    else:
        assert scene.where(call.id) == {"queued": 1, "unacked": 0}
        assert task_id_of(scene.take_as_dying_worker()) == call.id
        if scene.fetch == "kombu":
            wait_for(lambda: ("lease_extension_failed", "broker_lost") in scene.events(call.id),
                     what="the heartbeat to find its lease lost")
        scene.release(key)
        assert call.get(timeout=30) == key
        assert scene.dead_letter(call.id) is None
    wait_for(lambda: scene.gone(call.id), timeout=30, what="no copy left")
    assert scene.runs(key) == 1
    assert scene.phases(call.id).count("intent") == 1


# -- 5. a SIGKILL at a boundary of the attempt ---------------------------------------


@pytest.mark.parametrize(("boundary", "process", "tool", "ending"), [
    # Killed before its intent: the score was never raised; kombu restores the
    # message after the visibility timeout and it runs.
    ("before_intent", "worker", "tools.write_deadline", "SUCCESS"),
    # Killed with its intent recorded and its score raised: the message stays
    # unacknowledged until the deadline (tools.write_limited: 5 s; its body
    # never starts here, so its 1 s time limit plays no part), then its next
    # delivery finds the attempt interrupted.
    ("after_intent", "worker", "tools.write_limited", "interrupted_write"),
    # Only the pool process dies after the begin: the worker's main process
    # settles the attempt it handed over (WorkerLostError) at once.
    ("after_intent", "pool", "tools.write_deadline", "interrupted_write"),
    # Killed after the outcome's script, which acknowledged the message too,
    # before the main process forgot it.
    ("before_ack", "worker", "tools.write_deadline", "SUCCESS"),
])
def test_a_deadline_write_killed_at_a_boundary_ends_once(
    scene: Scene, boundary: str, process: str, tool: str, ending: str,
) -> None:
    """A worker SIGKILLed at one boundary of a deadline write (the whole worker,
    or only its pool process): where the message is right after the kill, then
    how the call ends (run once, or a dead letter without running), with no
    copy left on the broker."""
    crashing = scene.worker(
        concurrency=1, TOOLEFFECT_CRASH_AT=f"{boundary}@{tool}",
        TOOLEFFECT_CRASH_MARK=str(scene.logs / "crash-mark"), TOOLEFFECT_CRASH_PROCESS=process)
    key = uuid.uuid4().hex[:8]
    call = scene.send(tool, key)
    if process == "worker":
        wait_for(lambda: crashing.process.poll() is not None, what="the worker to be killed")
        tag = scene.tag_of(call.id)
        if boundary == "before_ack":
            assert tag is None and scene.queued(call.id) == 0
            assert call.state == "SUCCESS"
        else:
            assert tag is not None
            score = scene.score(tag)
            assert score is not None
            if boundary == "after_intent":
                assert scene.journal(call.id)["state"] == "running"
                lease_until = float(AuditLog(scene.app).events(call.id)[0]["lease_until"])
                assert score == pytest.approx(lease_until - VT, abs=0.01)
            else:
                assert score < time.time() and scene.journal(call.id) == {}
            scene.worker(concurrency=1)
    if ending == "SUCCESS":
        assert call.get(timeout=30) == key
        assert scene.runs(key) == 1
    else:
        letter = wait_for(lambda: scene.dead_letter(call.id), timeout=30,
                          what="the interrupted write's dead letter")
        assert letter.reason == ending
        assert scene.runs(key) == 0
    wait_for(lambda: scene.gone(call.id), what="no copy left")
    assert scene.phases(call.id).count("intent") == 1


# -- 6. every delivery that records nothing leaves a trace (issue 28, item 3) ------


@pytest.mark.parametrize("verdict", ["lost", "busy"])
def test_a_refused_lease_is_logged_with_the_task_id_when_its_audit_event_is_refused(
    scene_with_store: Scene, verdict: str,
) -> None:
    """A delivery whose broker lease is refused records nothing in the journal
    (``lease_lost``: its other copy runs; ``lease_busy``: retried). Its trace is
    a ``lease_refused`` audit event and a worker log line naming the task id
    (the tests above check both); when the store refuses the event, the log
    line is there all the same and says so. The store is apart from the
    broker here, so the lease is refused by ``extend_lease.lua`` before the
    intent's script (the tests above: by the intent's script itself)."""
    scene = scene_with_store
    assert scene.store is not None
    # A retry is published for every delivery the unwritable store turns away.
    scene.worker(concurrency=1, TE_MAX_RETRIES="50")
    key = uuid.uuid4().hex[:8]
    scene.hold_mutex()
    call = scene.send("tools.write_deadline", key)
    tag = wait_for(lambda: scene.tag_of(call.id), what="the worker to take the call")
    assert tag is not None
    scene.store.refuse_writes()
    if verdict == "lost":
        scene.restore(tag)
        scene.drop_mutex()
    refused = f"tools.write_deadline[{call.id}]: broker lease {verdict} before the write began"
    line = wait_for(lambda: next((line for line in scene.log_lines(call.id) if refused in line),
                                 None), what="the worker's log line")
    assert line is not None and "its audit event was not stored" in line
    assert scene.events(call.id) == []
    if verdict == "lost":
        wait_for(lambda: said(scene, call.id, "not acknowledged"),
                 what="the log line of the delivery forgotten")
    scene.store.accept_writes()
    scene.drop_mutex()
    assert call.get(timeout=30) == key
    wait_for(lambda: scene.gone(call.id), what="no copy left")
    assert scene.runs(key) == 1
    assert scene.phases(call.id)[-2:] == ["intent", "outcome"]


def test_a_lease_the_broker_cannot_extend_is_audited_and_the_message_kept(
    scene_with_store: Scene,
) -> None:
    """The broker refuses the lease's write (a full Redis, OOM): ``unavailable``.
    The delivery records a ``lease_refused`` event and a log line naming the
    task, and is not run. Its retry cannot be published on the full broker
    (``Reject(requeue=True)``), and kombu's requeue, a restore transaction,
    is refused too: Celery stops the worker ("Unrecoverable error"), the
    message still unacknowledged. Once the broker takes writes, the next
    worker's sweep restores it and it runs, once."""
    scene = scene_with_store
    worker = scene.worker(concurrency=1)
    key = uuid.uuid4().hex[:8]
    scene.hold_mutex()
    call = scene.send("tools.write_deadline", key)
    assert wait_for(lambda: scene.tag_of(call.id), what="the worker to take the call")
    scene.server.refuse_writes()
    scene.drop_mutex()  # DEL is allowed on a full Redis
    wait_for(lambda: ("lease_refused", "unavailable") in scene.events(call.id),
             what="the refused lease's audit event")
    assert said(scene, call.id, "broker lease unavailable before the write began (audited)")
    # The retry's publish is tried, and refused, after the event is stored.
    wait_for(lambda: said(scene, call.id, "not published, requeueing"),
             what="the log line of the retry the broker refused")
    wait_for(lambda: worker.process.poll() is not None, timeout=60,
             what="Celery to stop the worker whose requeue the broker refused")
    assert "Unrecoverable error" in worker.output()
    assert scene.where(call.id) == {"queued": 0, "unacked": 1}
    scene.server.accept_writes()
    scene.worker(concurrency=1)
    assert call.get(timeout=30) == key
    wait_for(lambda: scene.gone(call.id), what="no copy left")
    assert scene.runs(key) == 1
    assert scene.phases(call.id) == ["lease_refused", "intent", "outcome"]
