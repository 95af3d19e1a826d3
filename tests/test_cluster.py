"""The store on a real Redis Cluster: three ``redis-server --cluster-enabled yes``
nodes started by the test, joined with ``redis-cli --cluster create``.

All keys of a run carry the run id as their hash tag, so every journal script
touches one slot; the copy to the global stream is a separate command that
may land on another node. The broker (and so the dead letters) stays on the
single Redis: kombu's Redis transport does not support Cluster. With RabbitMQ
the dead letters are kept in the cluster (tests/test_cluster_rabbitmq.py).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster

from celery_tooleffect import AuditLog, ConfigurationError, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.events import AuditEvent
from celery_tooleffect.store.audit import StepContext
from celery_tooleffect.store.journal import Journal, JournalRef
from celery_tooleffect.store.keys import Keys
from celery_tooleffect.store.states import JournalState, Verdict
from tests.conftest import redis_server_binary, running_worker, wait_for


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 55000 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class Cluster:
    """Three primaries, no replicas, all slots covered."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.ports[0])

    def node_of(self, key: str) -> int:
        """The port of the node that serves ``key``."""
        return int(self.client().get_node_from_key(key).port)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not on PATH: it is needed to create the cluster")
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="tooleffect-cluster-"))
        stack.callback(shutil.rmtree, workdir, True)
        ports = [cluster_port() for _ in range(3)]
        processes: list[subprocess.Popen[bytes]] = []

        def stop() -> None:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)

        stack.callback(stop)
        for port in ports:
            node = workdir / str(port)
            node.mkdir()
            processes.append(subprocess.Popen(
                [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", str(node / "nodes.conf"),
                 "--cluster-node-timeout", "5000", "--save", "", "--appendonly", "no",
                 "--dir", str(node)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        for port in ports:
            wait_for(lambda port=port: _pings(port), timeout=10, what=f"node {port}")
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )
        assert created.returncode == 0, created.stdout + created.stderr
        for port in ports:
            wait_for(lambda port=port: redis.Redis(port=port).cluster("info")
                     .get("cluster_state") == "ok", timeout=30, what=f"node {port} ok")
        yield Cluster(ports)


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def cluster_app(make_app: Callable[..., Celery], cluster: Cluster) -> Celery:
    return make_app(tooleffect_redis_url=cluster.url, tooleffect_redis_cluster=True)


def run_ids_on_every_node(cluster: Cluster, keys: Keys) -> list[str]:
    """Run ids (some with braces) whose keys live on each of the three nodes."""
    found: dict[int, str] = {}
    candidates = (f"run-{{{n}}}-{uuid.uuid4().hex[:6]}" for n in range(10_000))
    for run_id in candidates:
        found.setdefault(cluster.node_of(keys.run_events(run_id)), run_id)
        if len(found) == len(cluster.ports):
            return list(found.values())
    raise AssertionError("no run ids found for every node")


def runs_copied_to_every_node(cluster: Cluster, keys: Keys) -> list[str]:
    """Run ids whose global copy lands on each of the three nodes, chosen (not
    drawn) so that a follower that skipped a node's shards is always caught."""
    found: dict[int, str] = {}
    for n in range(10_000):
        run_id = f"run-{n}-{uuid.uuid4().hex[:6]}"
        found.setdefault(cluster.node_of(keys.global_stream(run_id)), run_id)
        if len(found) == len(cluster.ports):
            return list(found.values())
    raise AssertionError("no run ids copied to every node")


def test_journal_and_audit_scripts_on_a_cluster(cluster: Cluster, cluster_app: Celery) -> None:
    audit = AuditLog(cluster_app)
    journal = Journal(audit.settings, audit)
    assert isinstance(audit.client, RedisCluster)
    keys = audit.keys
    runs = run_ids_on_every_node(cluster, keys)
    for run_id in runs:
        task_id = f"task-{{{uuid.uuid4().hex}}}"  # braces in the task id too
        ref = JournalRef(run_id, task_id)
        context = StepContext(run_id=run_id, task_id=task_id, tool="cluster.write",
                              effect=ToolEffect.NON_IDEMPOTENT_WRITE, queue="tools",
                              redelivered=False, worker="test:1")
        begin = journal.begin_attempt(
            ref, token="t1", effect="non_idempotent_write", lease_end=time.time() + 60,
            attempts_allowed=3, event=context.event("intent", "started"),
        )
        assert begin.verdict is Verdict.STARTED and begin.attempt == 1
        assert journal.renew_lease(ref, token="t1", lease_end=time.time() + 90)
        moved = journal.transition(
            ref, new_state=JournalState.SUCCEEDED, allowed=frozenset({JournalState.RUNNING}),
            token="t1",
            event=context.event("outcome", "succeeded", attempt=1),
            earlier_copy=begin.intent_event,
        )
        assert moved and moved.previous_state == "running"
        assert audit.record_step(context.event("note", "after"))
        again = journal.begin_attempt(
            ref, token="t2", effect="non_idempotent_write", lease_end=time.time() + 60,
            attempts_allowed=3, event=context.event("intent", "started"),
        )
        assert again.verdict is Verdict.DONE

        assert journal.read(ref)["state"] == "succeeded"
        events = audit.events(run_id)
        assert [(e["phase"], e["seq"]) for e in events] == [
            ("intent", "1"), ("outcome", "2"), ("note", "3"), ("duplicate_ignored", "4"),
        ]
        check = audit.verify(run_id)
        assert check.intact and check.events == 4, check
        # The run's keys are on one node; the global stream may be on another.
        nodes = {cluster.node_of(key) for key in
                 (keys.journal(run_id, task_id), keys.run_events(run_id))}
        assert len(nodes) == 1
    tail = audit.tail(100)
    assert len(tail) == 12 and {e["phase"] for e in tail} >= {"intent", "outcome", "note"}
    # The global copy is spread over shards (store/keys.py), a run's copies in
    # its own: read back merged, each run's copies are in their order.
    for run_id in runs:
        assert [e["phase"] for e in tail if e["run_id"] == run_id] == [
            "intent", "outcome", "note", "duplicate_ignored"]
    client = audit.client
    assert {stream for stream in keys.global_streams if client.xlen(stream)} == {
        keys.global_stream(run_id) for run_id in runs}
    assert not client.exists(keys.global_events)


def test_a_worker_with_its_store_on_a_cluster(
    cluster: Cluster, cluster_app: Celery, main_redis: redis.Redis,
) -> None:
    app = cluster_app
    runs: list[str] = []

    @app.task(base=ToolTask, name="cluster.send", shared=False, bind=True,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=30)
    def send(self: Any, amount: int) -> int:
        runs.append(str(self.request.id))
        if amount < 0:
            raise ValueError("negative")
        return amount

    @app.task(base=ToolTask, name="cluster.set", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def set_value(value: str) -> str:
        return value

    @app.task(base=ToolTask, name="cluster.read", shared=False)
    def read(value: str) -> str:
        return value

    with running_worker(app):
        sent = send.apply_async((5,), headers={"tooleffect_run_id": "agent-{run}-1"})
        assert sent.get(timeout=20) == 5
        assert set_value.delay("x").get(timeout=20) == "x"
        assert read.delay("y").get(timeout=20) == "y"
        refused = send.apply_async((-1,), headers={"tooleffect_run_id": "agent-{run}-1"})
        letter = wait_for(lambda: DeadLetters(app).get(refused.id), what="the dead letter")

    assert runs.count(sent.id) == 1 and runs.count(refused.id) == 1
    assert letter.reason == "not_retryable"
    audit = AuditLog(app)
    journal = Journal(audit.settings, audit)
    assert journal.read(JournalRef("agent-{run}-1", sent.id))["state"] == "succeeded"
    assert journal.read(JournalRef("agent-{run}-1", refused.id))["state"] == "dead_lettered"
    phases = [(e["task_id"], e["phase"]) for e in audit.events("agent-{run}-1")]
    assert phases == [
        (sent.id, "intent"), (sent.id, "outcome"),
        (refused.id, "intent"), (refused.id, "outcome"), (refused.id, "dead_lettered"),
    ]
    # The dead letter is in the broker's Redis, not in the cluster.
    assert main_redis.hexists(audit.keys.dead_letters("tools"), refused.id)


def test_a_cluster_store_needs_its_own_url(make_app: Callable[..., Celery]) -> None:
    """A broker that is not Redis is accepted (the dead letters are then kept in
    the cluster: tests/test_cluster_rabbitmq.py); the store must be named."""
    app = make_app(broker_url="memory://", tooleffect_redis_cluster=True,
                   tooleffect_redis_url="redis://127.0.0.1:7000/0")
    assert AuditLog(app).settings.dead_letter_endpoint.cluster
    assert DeadLetters(app).keys.dead_letters_in_one_slot
    app = make_app(tooleffect_redis_cluster=True)
    with pytest.raises(ConfigurationError, match="needs tooleffect_redis_url"):
        AuditLog(app)


def test_audit_tail_follows_every_shard_of_a_cluster(
        cluster: Cluster, cluster_app: Celery, prefix: str) -> None:
    """``audit tail --follow`` on a cluster store reads each shard of the
    global copy (one ``XREAD`` cannot name several slots): an event of a run
    on each node shows."""
    from tests.test_cli import TESTS, subprocess_env

    env = {**subprocess_env(prefix), "TE_STORE": cluster.url, "TE_STORE_CLUSTER": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "celery_tooleffect.admin.cli", "-A", "tests.apps.tool_app",
         "audit", "tail", "--follow", "--count", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=str(TESTS.parent))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")),
                              daemon=True)  # type: ignore[union-attr]
    reader.start()
    audit = AuditLog(cluster_app)
    runs = runs_copied_to_every_node(cluster, audit.keys)
    try:
        wait_for(lambda: lines, timeout=30, what="the tail's header")
        for _ in range(50):  # until the follower has read every shard once
            for run_id in runs:
                assert audit.record_step(AuditEvent.of(
                    run_id=run_id, task_id="t", tool="x", effect="read_only", phase="note",
                    status="seen", worker="test:1", queue="tools"))
            if all(any(run_id in line for line in lines) for run_id in runs):
                break
            time.sleep(0.2)
        wait_for(lambda: all(any(run_id in line for line in lines) for run_id in runs),
                 timeout=10, what="an event of every run")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert code == 0, process.stderr.read() if process.stderr else ""
