"""Replicated intents: a write's body runs only over an intent its replicas hold.

Real servers: a primary and a replica (``--replicaof``) started by the test;
the replica is frozen with SIGSTOP so that ``WAIT`` falls short. Real workers
(tests/apps/prod_app.py), whose bodies count their runs in files.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_tooleffect import DeadLetters
from celery_tooleffect.events import AuditEvent
from celery_tooleffect.store.durability import Durability
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.keys import Keys
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.servers import online_replicas
from celery_tooleffect.testing import RedisServer, WorkerProcess, redis_server
from tests.conftest import TESTS, app_config, start_celery_worker, wait_for
from tests.support import run_fields
from tests.topologies import MASTER, sentinel_set


@pytest.fixture
def primary() -> Iterator[RedisServer]:
    with redis_server(appendonly=True) as server:
        yield server


@pytest.fixture
def replica(primary: RedisServer) -> Iterator[RedisServer]:
    with redis_server("--replicaof", "127.0.0.1", str(primary.port)) as server:
        wait_for(lambda: online_replicas(primary.client()) == 1,
                 timeout=15, what="the replica to be in sync")
        yield server


def _worker(tmp_path: Path, prefix: str, broker: str, settings: dict[str, Any],
            transport: dict[str, Any] | None = None, wait: bool = True) -> WorkerProcess:
    runs = tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    env = {"TE_PREFIX": prefix, "TE_BROKER": broker, "TE_BACKEND": broker,
           "TE_RUNS": str(runs), "TE_SETTINGS": json.dumps(settings),
           "TE_TRANSPORT": json.dumps(transport or {}),
           "TE_BACKEND_TRANSPORT": json.dumps(transport or {})}
    return start_celery_worker("tests.apps.prod_app", tmp_path / f"w-{uuid.uuid4().hex[:4]}.log",
                               env=env, root=TESTS.parent, wait=wait)


def _producer(prefix: str, broker: str) -> Celery:
    app = Celery("replication-producer", set_as_current=False)
    app.conf.update(app_config(prefix, broker_url=broker, result_backend=broker,
                               broker_transport_options={"global_keyprefix": prefix},
                               result_backend_transport_options={"global_keyprefix": prefix},
                               tooleffect_max_retries=5))
    return app


def _refused(worker: WorkerProcess) -> str:
    """The output of a worker that must exit at start."""
    wait_for(lambda: worker.process.poll() is not None, timeout=60,
             what="the worker to refuse to start")
    return worker.output()


def test_an_intent_no_replica_acknowledged_never_runs_its_body(
        primary: RedisServer, replica: RedisServer, tmp_path: Path, prefix: str) -> None:
    settings = {"tooleffect_store_replicas": 1, "tooleffect_store_wait_timeout": 0.3}
    worker = _worker(tmp_path, prefix, primary.url, settings)
    producer = _producer(prefix, primary.url)
    letters = DeadLetters(producer)
    try:
        assert replica.process is not None
        os.kill(replica.process.pid, signal.SIGSTOP)  # WAIT 1 can no longer be met
        try:
            frozen = producer.send_task("prod.write", ("frozen",))
            wait_for(lambda: letters.get(frozen.id) is not None, timeout=60,
                     what="the call to end as a dead letter")
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        letter = letters.get(frozen.id)
        assert letter is not None and letter.reason == "retries_exhausted", letter
        assert not (tmp_path / "runs" / "frozen").exists(), "a body ran over an unreplicated intent"
        events = run_fields(primary.client(), Keys(f"{prefix}te:").run_events(frozen.id))
        intents = [e for e in events if e[b"phase"] == b"intent"]
        failures = [e for e in events if e[b"phase"] == b"outcome"]
        # Every attempt recorded its intent, found it unreplicated and failed
        # before its body as a connection failure: the whole retry budget.
        assert len(intents) == len(failures) == 6
        assert {e[b"exception_type"] for e in failures} == {b"IntentNotDurable"}
        assert {e[b"failure_class"] for e in failures} == {b"connection"}

        # The replica is back: the next write waits for it and runs once.
        assert producer.send_task("prod.write", ("thawed",)).get(timeout=30) == "wrote thawed"
        assert (tmp_path / "runs" / "thawed").read_text().count("\n") == 1
    finally:
        worker.stop()


#: A write waits out a store short of replicas within this budget (about 15 s).
WAITING = {"tooleffect_store_replicas": 1, "tooleffect_store_wait_timeout": 0.3,
           "tooleffect_max_retries": 40, "tooleffect_backoff_base": 0.2,
           "tooleffect_backoff_cap": 0.4}


def _intents(server: RedisServer, prefix: str, task_id: str) -> int:
    return sum(1 for fields in run_fields(server.client(), Keys(f"{prefix}te:").run_events(task_id))
               if fields[b"phase"] == b"intent")


def test_a_store_short_of_replicas_starts_runs_reads_and_holds_writes(
        primary: RedisServer, tmp_path: Path, prefix: str) -> None:
    """Replicas in sync are a state that changes by itself: a standalone store
    with none of the one asked for starts, reads run, a write waits (each
    attempt ends before its body) and runs once a replica is in sync."""
    worker = _worker(tmp_path, prefix, primary.url, WAITING)
    producer = _producer(prefix, primary.url)
    try:
        assert ("has 0 of the 1 replica(s) in sync that tooleffect_store_replicas asks for: "
                "reads run, and writes end before their bodies") in worker.output()
        assert producer.send_task("prod.read", ("r",)).get(timeout=30) == "read r"
        held = producer.send_task("prod.write", ("held",))
        wait_for(lambda: _intents(primary, prefix, held.id) >= 3, timeout=30,
                 what="the write to try and wait")
        assert not (tmp_path / "runs" / "held").exists(), "a body ran over an unreplicated intent"
        with redis_server("--replicaof", "127.0.0.1", str(primary.port)):
            assert held.get(timeout=60) == "wrote held"
            wait_for(lambda: "replica(s) in sync again: writes run" in worker.output(),
                     timeout=30, what="the worker to say the replicas are back")
        assert (tmp_path / "runs" / "held").read_text().count("\n") == 1
    finally:
        worker.stop()


def test_more_replicas_than_the_sentinels_know_are_refused_at_start(
        tmp_path: Path, prefix: str) -> None:
    """Behind Sentinel a replica that is down is still known: asking for more
    than the Sentinels know can never work (tooleffect_store_replicas is 1 by
    default behind Sentinel)."""
    with sentinel_set(replicas=0) as group:
        worker = _worker(tmp_path, prefix, group.urls, {},
                         transport={"master_name": MASTER}, wait=False)
        output = _refused(worker)
    assert "tooleffect_store_replicas is 1 but the Sentinels of the journal and audit" in output
    assert "know 0 replica(s) in all" in output


def test_behind_sentinel_a_replica_down_at_start_holds_writes_until_it_is_back(
        tmp_path: Path, prefix: str) -> None:
    """The Sentinel set-up of issue 37: its one replica is down when the worker
    starts. The worker starts, reads run, writes wait, and run once when the
    replica is back."""
    with sentinel_set(replicas=1) as group:
        replica = group.servers[1]
        replica.kill()
        master = group.master()
        wait_for(lambda: online_replicas(master.client()) == 0, timeout=15,
                 what="the primary to see its replica gone")
        worker = _worker(tmp_path, prefix, group.urls, WAITING,
                         transport={"master_name": MASTER})
        producer = _producer(prefix, group.urls)
        producer.conf.broker_transport_options = {"global_keyprefix": prefix,
                                                  "master_name": MASTER}
        producer.conf.result_backend_transport_options = {"global_keyprefix": prefix,
                                                          "master_name": MASTER}
        try:
            assert "has 0 of the 1 replica(s) in sync" in worker.output()
            assert producer.send_task("prod.read", ("r",)).get(timeout=30) == "read r"
            held = producer.send_task("prod.write", ("held",))
            wait_for(lambda: _intents(master, prefix, held.id) >= 3, timeout=30,
                     what="the write to try and wait")
            assert not (tmp_path / "runs" / "held").exists()
            replica.start()
            assert held.get(timeout=60) == "wrote held"
            assert (tmp_path / "runs" / "held").read_text().count("\n") == 1
        finally:
            worker.stop()


def test_fsync_is_refused_by_a_store_without_waitaof(
        primary: RedisServer, tmp_path: Path, prefix: str) -> None:
    version = tuple(int(part) for part in str(
        primary.client().info("server")["redis_version"]).split(".")[:2])
    if version >= (7, 2):
        pytest.skip("this redis-server has WAITAOF")
    worker = _worker(tmp_path, prefix, primary.url, {"tooleffect_store_fsync": True},
                     wait=False)
    assert "refuses WAITAOF" in _refused(worker)


def test_a_store_with_replicas_and_no_wait_is_warned_about(
        primary: RedisServer, replica: RedisServer, tmp_path: Path, prefix: str) -> None:
    worker = _worker(tmp_path, prefix, primary.url, {})
    try:
        assert "has 1 replica(s) and tooleffect_store_replicas is 0" in worker.output()
    finally:
        worker.stop()


def test_a_master_name_the_sentinels_do_not_know_is_refused(
        tmp_path: Path, prefix: str) -> None:
    with sentinel_set(replicas=0) as group:
        worker = _worker(tmp_path, prefix, group.urls, {},
                         transport={"master_name": "no-such-master"}, wait=False)
        output = _refused(worker)
    assert "know no master named 'no-such-master'" in output


def test_the_intent_and_its_wait_share_one_round_trip(
        primary: RedisServer, replica: RedisServer, prefix: str) -> None:
    """WAIT rides in the intent's own round trip: on the intent's connection,
    MONITOR sees the script and then WAIT, nothing in between."""
    app = _producer(prefix, primary.url)
    app.conf.tooleffect_store_replicas = 1
    journal = runtime_for(app).journal
    assert journal.durability == Durability(1, False, 1000)
    ref = JournalRef("run-1", "task-1")
    intent = AuditEvent(run_id=ref.run_id, task_id=ref.task_id, tool="prod.write",
                        effect="non_idempotent_write", phase="intent", status="started",
                        worker="test", queue="tools")
    seen: list[dict[str, Any]] = []
    with primary.client().monitor() as monitor:
        begin = journal.begin_attempt(
            ref, token="t", effect="non_idempotent_write", lease_end=time.time() + 30,
            attempts_allowed=3, event=intent)
        for command in monitor.listen():
            if command.get("client_type") != "lua":  # the script's own calls
                seen.append(command)
            if str(command["command"]).startswith("WAIT"):
                break
    assert begin.verdict.value == "started"
    wait = seen[-1]
    mine = [c["command"].split()[0] for c in seen if c["client_address"] == wait["client_address"]
            and c["client_port"] == wait["client_port"]]
    assert mine[-2:] == ["EVALSHA", "WAIT"], mine
