"""The deployment that scales out: RabbitMQ (a quorum queue) for the messages,
a Redis Cluster for the store, and no single Redis on the hot path.

Real processes: three ``redis-server --cluster-enabled yes`` nodes the test
creates (the ``cluster`` fixture of tests/test_cluster.py), a virtual host of
the test's own on RabbitMQ, and ``celery worker`` subprocesses of
tests/apps/tool_app.py (``TE_STORE_CLUSTER=1``). The side-effect counters and
Celery's results stay on the suite's Redis; nothing of the package is there.

With a broker that is not Redis the dead letters are kept in the store, so on
a cluster they are too: every dead-letter key in the one slot ``{dlq}``
(store/keys.py), so that each dead-letter script touches one slot.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner, Result

from celery_tooleffect import Approvals, AuditLog, DeadLetters
from celery_tooleffect.admin.cli import tooleffect
from celery_tooleffect.store.dead_letter_queries import DeadLetterQuery
from celery_tooleffect.store.keys import GLOBAL_STREAM_SHARDS, Keys
from celery_tooleffect.store.runtime import runtime_for
from tests import test_cluster
from tests.conftest import (
    REDIS_URL,
    TESTS,
    Counter,
    WorkerProcess,
    free_port,
    rabbitmq_queues,
    wait_for,
)
from tests.letters import letter_of_call
from tests.test_cluster import Cluster

pytestmark = [pytest.mark.timeout(240), pytest.mark.cluster]

#: The three-node cluster of tests/test_cluster.py, created by this test.
cluster = test_cluster.cluster


@pytest.fixture
def app(make_app: Callable[..., Celery], cluster: Cluster, rabbitmq_url: str) -> Celery:
    """The producer: RabbitMQ (quorum queue ``tools``), the store on the cluster."""
    return make_app(broker_url=rabbitmq_url, broker_transport_options={},
                    result_backend=REDIS_URL, tooleffect_redis_url=cluster.url,
                    tooleffect_redis_cluster=True, tooleffect_heartbeat_interval=0.5,
                    **rabbitmq_queues("quorum"))


@pytest.fixture
def worker(spawn_worker: Callable[..., WorkerProcess], cluster: Cluster,
           rabbitmq_url: str) -> Callable[..., WorkerProcess]:
    def start(**env: str) -> WorkerProcess:
        return spawn_worker(broker_url=rabbitmq_url, store_url=cluster.url,
                            TE_STORE_CLUSTER="1", TE_QUEUE_TYPE="quorum", **env)
    return start


@pytest.fixture
def flower(prefix: str, tmp_path: Path, cluster: Cluster,
           rabbitmq_url: str) -> Iterator[Callable[[], str]]:
    """Start ``celery -A tests.apps.tool_app tooleffect flower`` on the test's
    broker and cluster; its URL."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> str:
        port = free_port()
        environment = dict(os.environ, TE_PREFIX=prefix, TE_BROKER=rabbitmq_url,
                           TE_COUNTERS=REDIS_URL, TE_STORE=cluster.url, TE_STORE_CLUSTER="1",
                           TE_QUEUE_TYPE="quorum", PYTHONPATH=str(TESTS.parent))
        log = tmp_path / f"flower-{port}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "tooleffect",
             "flower", f"--port={port}", "--address=127.0.0.1", f"--basic-auth={FLOWER_USER}"],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env=environment,
            cwd=str(TESTS.parent), start_new_session=True)
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(f"{url}/healthcheck")[0] == 200 or process.poll() is not None,
                 timeout=60, what="Flower to answer")
        assert process.poll() is None, log.read_text(errors="replace")
        return url

    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


#: Flower's basic authentication in these tests (its API asks for one).
FLOWER_USER = "ops:s3cret"


def http_get(url: str) -> tuple[int, str]:
    """GET ``url`` as :data:`FLOWER_USER`: the status and the body."""
    request = urllib.request.Request(url)
    request.add_header("Authorization", "Basic " + base64.b64encode(FLOWER_USER.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()
    except OSError:
        return 0, ""


def invoke(app: Celery, *args: str) -> Result:
    """``celery -A <app> tooleffect <args>`` in this process."""
    from celery.bin.base import CLIContext

    return CliRunner().invoke(
        tooleffect, list(args), obj=CLIContext(app=app, no_color=True, workdir=None),
        env={"COLUMNS": "120", "TOOLEFFECT_ACTOR": "ops-tester"})


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def package_keys(cluster: Cluster, prefix: str) -> list[str]:
    """Every key under ``prefix`` on every node of the cluster."""
    found: list[str] = []
    for port in cluster.ports:
        node = redis.Redis(port=port)
        found += [key.decode() for key in node.scan_iter(match=f"{prefix}*", count=1000)]
    return found


def test_effects_dead_letters_replay_and_approvals_on_rabbitmq_with_a_cluster_store(
    app: Celery, worker: Callable[..., WorkerProcess], cluster: Cluster, counter: Counter,
    main_redis: redis.Redis, prefix: str, flower: Callable[[], str],
) -> None:
    """Each effect runs once. A NON_IDEMPOTENT_WRITE whose pool child is
    SIGKILLed mid-body, and one whose whole worker is, are dead-lettered
    (each body ran once); they are listed, shown and counted by the CLI, by
    Flower's JSON API and its /metrics; one is replayed from the CLI (it runs
    once more, once), the other purged, and nothing of them stays. A call that
    needs approval runs once approved. The dead letters are in the cluster, in
    one slot; the suite's Redis holds no key of the store."""
    process = worker()
    for tool in ("tools.read", "tools.idempotent", "tools.write"):
        result = app.send_task(tool, args=[tool, 0.0], queue="tools")
        assert result.get(timeout=60) == tool, process.output()[-3000:]
        assert counter.value(tool) == 1

    # A pool child killed mid-body: RabbitMQ redelivers (reject_on_worker_lost);
    # the journal's lapsed lease makes it a dead letter.
    killed = app.send_task("tools.write", args=["killed", 60.0], queue="tools")
    child = int(wait_for(lambda: main_redis.lrange(f"{prefix}started:killed", 0, -1),
                         what="the write's body to start")[0])
    assert child != process.process.pid
    os.kill(child, signal.SIGKILL)
    letter = wait_for(lambda: DeadLetters(app).get(killed.id), timeout=90,
                      what="the dead letter\n" + process.output()[-3000:])
    assert letter.reason == "interrupted_write" and letter.effect == "non_idempotent_write"
    assert letter.message is not None  # as RabbitMQ delivered it
    assert counter.value("killed") == 1

    # The whole worker killed mid-body: the channel closes, RabbitMQ requeues,
    # the next worker finds the lease lapsed.
    lost = app.send_task("tools.write", args=["lost", 60.0], queue="tools")
    wait_for(lambda: main_redis.lrange(f"{prefix}started:lost", 0, -1),
             what="the second write's body to start")
    process.kill()
    process = worker()
    second = wait_for(lambda: DeadLetters(app).get(lost.id), timeout=90,
                      what="the second dead letter\n" + process.output()[-3000:])
    assert second.reason == "interrupted_write"
    assert counter.value("lost") == 1

    # Kept in the cluster, every dead-letter key in the slot of {dlq}.
    keys = runtime_for(app).dead_letters.keys
    assert keys.dead_letters_in_one_slot
    dlq_keys = [key for key in package_keys(cluster, prefix)
                if key.startswith(f"{keys.prefix}{{dlq}}")]
    assert keys.dead_letters("tools") in dlq_keys and keys.dead_letter_all in dlq_keys
    client = cluster.client()
    assert {client.keyslot(key) for key in dlq_keys} == {client.keyslot(keys.dead_letter_all)}

    listed = as_json(invoke(app, "dlq", "list", "--json"))
    assert [row["task_id"] for row in listed["dead_letters"]] == [lost.id, killed.id]
    only = as_json(invoke(app, "dlq", "list", "--json", "--queue", "tools",
                          "--effect", "non_idempotent_write", "--limit", "1"))
    assert [row["task_id"] for row in only["dead_letters"]] == [lost.id]
    assert only["next_cursor"] is not None
    shown = as_json(invoke(app, "dlq", "show", killed.id, "--json"))
    assert shown["dead_letter"]["task_id"] == killed.id
    assert shown["dead_letter"]["reason"] == "interrupted_write"
    assert shown["journal"]["state"] == "dead_lettered"  # read from the run's slot
    assert shown["replay"]["needs_force"] is True
    stats = as_json(invoke(app, "dlq", "stats", "--json"))
    assert stats["total"] == 2 and stats["by_queue"] == {"tools": 2}
    backlog = DeadLetters(app).backlog()["tools"]
    assert backlog.count == 2 and backlog.oldest_at == pytest.approx(
        letter.dead_lettered_at, abs=1e-3)

    sizing = as_json(invoke(app, "store", "--sizing", "--json"))["sizing"]
    assert sizing["dead_letters"]["letters"] == 2 and sizing["dead_letters"]["in_the_store"]
    assert sizing["dead_letters"]["keys"] >= 2  # the queue's envelopes and index at least
    assert {kind["kind"]: kind["keys"] for kind in sizing["kinds"]}["dead letters"] == (
        sizing["dead_letters"]["keys"])

    url = flower()
    status, body = http_get(f"{url}/api/dead-letters")
    assert status == 200, body
    assert [row["task_id"] for row in json.loads(body)["dead_letters"]] == [lost.id, killed.id]
    status, body = http_get(f"{url}/api/dead-letters/{killed.id}")
    assert status == 200 and json.loads(body)["dead_letter"]["task_id"] == killed.id
    status, page = http_get(f"{url}/dead-letters")
    assert status == 200 and killed.id in page and lost.id in page
    status, metrics = http_get(f"{url}/metrics")
    assert status == 200, metrics
    gauge = re.search(r'^tooleffect_dead_letters\{[^}]*queue="tools"[^}]*'
                      r'reason="interrupted_write"[^}]*\} (\S+)$', metrics, re.M)
    assert gauge is not None and float(gauge.group(1)) == 2.0, metrics
    assert re.search(r'^tooleffect_oldest_dead_letter_age_seconds\{queue="tools"\} ',
                     metrics, re.M), metrics

    refused = invoke(app, "dlq", "replay", killed.id)  # a write: --force and a reason
    assert refused.exit_code != 0
    assert counter.value("killed") == 1
    replayed = invoke(app, "dlq", "replay", killed.id, "--force", "--reason", "checked: not sent")
    assert replayed.exit_code == 0, replayed.output
    wait_for(lambda: app.AsyncResult(killed.id).state == "SUCCESS", timeout=60,
             what="the replayed write to succeed\n" + process.output()[-3000:])
    assert counter.value("killed") == 2  # the killed run, and the replay's run
    assert DeadLetters(app).get(killed.id) is None
    phases = [e["phase"] for e in AuditLog(app).events(killed.id)]
    assert phases.count("replayed") == 1 and phases.count("intent") == 2

    # The journal of a dead-lettered write lasts as long as its letter; a
    # purge gives it the retention back (a pipeline over the runs' slots).
    journal_key = runtime_for(app).audit.keys.journal(lost.id, lost.id)
    assert client.ttl(journal_key) == -1
    purged = invoke(app, "dlq", "purge", lost.id, "--yes", "--reason", "sent by hand")
    assert purged.exit_code == 0, purged.output
    assert 0 < client.ttl(journal_key) <= runtime_for(app).settings.journal_ttl
    assert counter.value("lost") == 1
    assert as_json(invoke(app, "dlq", "list", "--json"))["dead_letters"] == []
    assert as_json(invoke(app, "dlq", "stats", "--json"))["total"] == 0
    # Resolved letters leave no dead-letter key behind.
    assert [key for key in package_keys(cluster, prefix)
            if key.startswith(f"{keys.prefix}{{dlq}}")] == []

    parked: Any = app.send_task("tools.approved_write", args=["approved"], queue="tools")
    wait_for(lambda: Approvals(app).get(parked.id), timeout=60, what="the call to be parked")
    assert counter.value("approved") == 0
    assert [a.task_id for a in Approvals(app).list()] == [parked.id]
    assert Approvals(app).approve(parked.id, by="alice", reason="fine").ok
    assert parked.get(timeout=60) == "approved"
    assert counter.value("approved") == 1
    # The suite's Redis holds counters and results only: no key of the store.
    assert not list(main_redis.scan_iter(match=f"{keys.prefix}*"))


# -- which slots the calls touch ----------------------------------------------------


_ARGUMENT = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)")
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b"}


def _unescape(text: str) -> bytes:
    """A MONITOR argument as sent (Redis escapes it with sdscatrepr)."""
    def one(match: re.Match[str]) -> str:
        code = match.group(1)
        if code.startswith("x") and len(code) == 3:
            return chr(int(code[1:], 16))
        return _ESCAPES.get(code, code)
    return _ESCAPE.sub(one, text).encode("latin-1", "replace")


@contextmanager
def monitored(cluster: Cluster) -> Iterator[dict[int, list[list[bytes]]]]:
    """The commands each node receives meanwhile (``MONITOR``), by port; the
    commands scripts run are left out (their keys are the script's)."""
    seen: dict[int, list[list[bytes]]] = {port: [] for port in cluster.ports}
    stop = threading.Event()
    monitors = []
    for port in cluster.ports:
        connection = redis.Connection(port=port, socket_timeout=0.5)
        connection.send_command("MONITOR")
        assert connection.read_response() in (b"OK", "OK")
        monitors.append((port, connection))

    def read(port: int, connection: redis.Connection) -> None:
        while True:
            try:
                line = connection.read_response()
            except redis.TimeoutError:
                if stop.is_set():
                    return
                continue
            except redis.ConnectionError:
                return
            text = line.decode("latin-1") if isinstance(line, bytes) else str(line)
            if "[0 lua]" in text or " lua]" in text:
                continue
            seen[port].append([_unescape(arg) for arg in _ARGUMENT.findall(text)])

    threads = [threading.Thread(target=read, args=pair, daemon=True) for pair in monitors]
    for thread in threads:
        thread.start()
    try:
        yield seen
    finally:
        # Every node echoes a mark; once each monitor has read it, every
        # command sent before it has been read too (MONITOR keeps the order).
        mark = f"census-end-{os.getpid()}".encode()
        for port in cluster.ports:
            redis.Redis(port=port).echo(mark)
        for port in cluster.ports:
            wait_for(lambda port=port: [b"echo", mark] in [
                [command[0].lower(), *command[1:]] for command in seen[port] if command],
                # The monitors parse every command of the census: slow on a
                # loaded machine.
                timeout=60, what=f"the mark on node {port}")
        stop.set()
        for thread in threads:
            thread.join(5)
        for _, connection in monitors:
            connection.disconnect()


def keys_of(node: redis.Redis, command: list[bytes]) -> list[bytes]:
    """The keys of ``command``, as the node's ``COMMAND GETKEYS`` names them."""
    if not command or command[0].upper() in (b"MONITOR", b"PING", b"ECHO", b"INFO", b"CLUSTER",
                                             b"SCRIPT", b"CLIENT", b"COMMAND", b"HELLO",
                                             b"READONLY", b"CONFIG", b"SELECT", b"DBSIZE"):
        return []
    try:
        found = node.command_getkeys(*command)
    except redis.ResponseError:
        return []
    return [key.encode("latin-1") if isinstance(key, str) else bytes(key) for key in found]


def slot_census(cluster: Cluster, seen: dict[int, list[list[bytes]]],
                prefix: str) -> tuple[Tally[int], Tally[bytes], dict[int, int]]:
    """Commands per slot and per key of the package (under ``prefix``), and
    commands per node."""
    per_slot: Tally[int] = Tally()
    per_key: Tally[bytes] = Tally()
    per_node: dict[int, int] = {}
    client = cluster.client()
    for port, commands in seen.items():
        node = redis.Redis(port=port)
        count = 0
        for command in commands:
            keys = [key for key in keys_of(node, command) if key.startswith(prefix.encode())]
            if not keys:
                continue
            count += 1
            for slot in {client.keyslot(key) for key in keys}:
                per_slot[slot] += 1
            for key in set(keys):
                per_key[key] += 1
        per_node[port] = count
    return per_slot, per_key, per_node


def ids_spread_over_shards(keys: Keys, count: int) -> list[str]:
    """``count`` random task ids whose runs fall evenly on the global stream's
    shards (at most one more on any shard than on another). Random ids fall
    binomially: with 90 calls over 16 shards, one shard in ten runs carries
    twice its share, and a census of that run would measure the dice, not the
    layout."""
    share = -(-count // GLOBAL_STREAM_SHARDS)
    taken: Tally[str] = Tally()
    ids: list[str] = []
    while len(ids) < count:
        task_id = str(uuid.uuid4())
        shard = keys.global_stream(task_id)
        if taken[shard] < share:
            taken[shard] += 1
            ids.append(task_id)
    return ids


def test_no_slot_is_touched_by_every_call(
    app: Celery, worker: Callable[..., WorkerProcess], cluster: Cluster, counter: Counter,
    prefix: str,
) -> None:
    """90 calls (30 of each effect, each its own run) through a worker: the
    commands each node receives (MONITOR), the keys they name (COMMAND
    GETKEYS) and the slots of those keys. Each call's keys are in its run's
    slot, so the calls spread over the three nodes; the global copy is spread
    over its shards (store/keys.py, one per run; the runs here fall evenly on
    them), so no slot or key is touched by as many commands as a quarter of
    the calls."""
    process = worker()
    warm = app.send_task("tools.read", args=["warm", 0.0], queue="tools")
    assert warm.get(timeout=60) == "warm", process.output()[-3000:]
    calls = 90
    keys = runtime_for(app).audit.keys
    ids = iter(ids_spread_over_shards(keys, calls))
    with monitored(cluster) as seen:
        results = [app.send_task(tool, args=[f"{tool}-{n}", 0.0], queue="tools",
                                 task_id=next(ids))
                   for n in range(calls // 3)
                   for tool in ("tools.read", "tools.idempotent", "tools.write")]
        for result in results:
            result.get(timeout=120)
    assert all(counter.value(f"{tool}-{n}") == 1 for n in range(calls // 3)
               for tool in ("tools.read", "tools.idempotent", "tools.write"))

    per_slot, per_key, per_node = slot_census(cluster, seen, prefix)
    client = cluster.client()
    hot_slots = {slot for slot, count in per_slot.items() if count >= calls // 4}
    hot_keys = {key for key, count in per_key.items() if count >= calls // 4}
    report = (f"commands per node {per_node}; hot slots {hot_slots}; busiest keys "
              f"{per_key.most_common(5)}")
    print(report)
    assert hot_slots == set(), report
    assert hot_keys == set(), report
    # Every call's copies went to its run's shard of the global stream, and the
    # shards sit on every node.
    shards = set(keys.global_streams)
    assert len(shards) == GLOBAL_STREAM_SHARDS
    written = {key.decode() for key in per_key if key.decode() in shards}
    assert written == {keys.global_stream(result.id) for result in results}, report
    assert {cluster.node_of(shard) for shard in shards} == set(cluster.ports)
    # Every run's keys are in its own slot: the calls' slots are many, on every node.
    run_slots = {client.keyslot(keys.run_events(result.id)) for result in results}
    assert len(run_slots) >= calls - 3
    assert all(count > 0 for count in per_node.values()), report
    assert {cluster.node_of(keys.run_events(result.id)) for result in results} == set(
        cluster.ports)


def test_every_dead_letter_operation_on_a_cluster(
    make_app: Callable[..., Celery], cluster: Cluster, prefix: str,
) -> None:
    """The whole DeadLetters API on the cluster, in process (the worker's,
    the CLI's and Flower's calls): store, find by task id alone, page across
    queues with filters and a cursor, counts, backlog, a late outcome copied
    on (a WATCH transaction), take, put back, take many, remove; resolved
    letters leave no key."""
    app = make_app(broker_url="memory://", tooleffect_redis_url=cluster.url,
                   tooleffect_redis_cluster=True)
    letters = DeadLetters(app)
    stored = []
    for n, (queue, effect) in enumerate([("tools", "read_only"), ("billing", "idempotent_write"),
                                         ("b{i}lling:eu", "non_idempotent_write"),
                                         ("tools", "non_idempotent_write")]):
        letter = letter_of_call(app, task_id=f"t{n}-{{x}}", name="tools.write", args=[n],
                                run_id=f"run-{n}", queue=queue, reason="not_retryable",
                                failure_class="auth", effect=effect, attempts=1,
                                dead_lettered_at=1_800_000_000.0 + n)
        assert letters.store(letter) and not letters.store(letter)  # the first one wins
        stored.append(letter)
    client = cluster.client()
    names = package_keys(cluster, prefix)
    assert names and {client.keyslot(key) for key in names} == {
        client.keyslot(letters.keys.dead_letter_all)}

    assert letters.get("t2-{x}").queue == "b{i}lling:eu"  # type: ignore[union-attr]
    assert letters.queues() == ["billing", "b{i}lling:eu", "tools"]
    first = letters.page(limit=2)
    assert [letter.task_id for letter in first.letters] == ["t3-{x}", "t2-{x}"]
    assert first.total == 4 and first.next_cursor is not None
    rest = letters.page(limit=2, before=first.next_cursor)
    assert [letter.task_id for letter in rest.letters] == ["t1-{x}", "t0-{x}"]
    writes = letters.page(DeadLetterQuery(queue="tools", effect="non_idempotent_write"))
    assert [letter.task_id for letter in writes.letters] == ["t3-{x}"]
    stats = letters.stats()
    assert stats.total == 4 and stats.by_queue == {"tools": 2, "billing": 1, "b{i}lling:eu": 1}
    assert sum(row.count for row in letters.counts()) == 4
    assert letters.backlog()["tools"].oldest_at == 1_800_000_000.0
    assert letters.record_late_outcome("t3-{x}", {"phase": "late_outcome", "status": "ok"})
    assert letters.get("t3-{x}").late_outcomes == [  # type: ignore[union-attr]
        {"phase": "late_outcome", "status": "ok"}]

    taken = letters.take("t0-{x}")
    assert taken is not None and letters.get("t0-{x}") is None
    assert letters.taken("t0-{x}") is not None
    assert letters.put_back(taken) and letters.get("t0-{x}") is not None
    held = letters.get_many(["t0-{x}", "t1-{x}", "nope"])
    assert held[2] is None
    assert letters.take_many([entry for entry in held if entry is not None]) == [True, True]
    letters.forget_taken_many(["t0-{x}", "t1-{x}"])
    assert letters.remove("t2-{x}") is not None and letters.remove("t3-{x}") is not None
    assert letters.stats().total == 0 and letters.counts() == []
    assert package_keys(cluster, prefix) == []


def test_a_cluster_store_still_needs_its_own_url(make_app: Callable[..., Celery],
                                                 rabbitmq_url: str) -> None:
    """With RabbitMQ the cluster is accepted; the store must still be named."""
    app = make_app(broker_url=rabbitmq_url, tooleffect_redis_cluster=True,
                   tooleffect_redis_url="redis://127.0.0.1:7000/0")
    settings = runtime_for(app).settings
    assert settings.dead_letter_endpoint.cluster and settings.store_endpoint.cluster
    assert runtime_for(app).dead_letters.keys.dead_letters("q") == (
        f"{settings.key_prefix}{{dlq}}:queue:q:envelopes")
