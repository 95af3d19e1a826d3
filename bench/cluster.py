"""The deployment that scales out, measured once: RabbitMQ (a quorum queue) for
the messages and the store on a three-node Redis Cluster, beside the same
calls with the store on one Redis.

```sh
.venv/bin/python -m bench.cluster                 # 3,000 calls, a third of each effect
.venv/bin/python -m bench.cluster --calls 600 --stores cluster
```

Needs a RabbitMQ on ``BENCH_RABBITMQ_URL`` (default amqp://guest:guest@127.0.0.1:5672)
and ``rabbitmqctl``: the run makes a virtual host of its own and deletes it.
It starts its own ``redis-server`` processes (a store of one node, or three
nodes joined with ``redis-cli --cluster create``, no persistence, so the
workers run with ``tooleffect_allow_volatile_store``; and one for Celery's
results) and ``celery -A bench.app worker`` processes.

Each store's round publishes the calls to the quorum queue while no worker
consumes it, then lets the workers consume it, waits for every result and
checks it is SUCCESS. Figures:

- **calls/s**: ``(N - 1) / (last date_done - first date_done)`` from the
  workers' own timestamps, as ``bench.calls`` rates a round;
- per store node: the **commands** it processed during the round (``INFO
  stats`` ``total_commands_processed``, after minus before, less the reads of
  this program), its **CPU** seconds (``INFO cpu``, user + system) and the
  **keys** it holds after (``DBSIZE``), with how many streams of the global
  audit copy it holds (one on a single Redis, a cluster's shards spread);
- **store CPU per call**: the nodes' CPU seconds over N. A Redis runs its
  commands on one core, so ``1 / (CPU per call of the busiest node)`` is the
  rate at which that node would be saturated: the figure docs/redis.md uses
  to say which deployment to pick at which rate.

On a shared machine the calls/s are indicative only (the workers, RabbitMQ
and the Redis processes share its cores); commands and keys per node are
counts, and do not depend on timing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from redis.cluster import RedisCluster

from celery_tooleffect.store.keys import store_keys
from celery_tooleffect.testing import (
    free_port,
    redis_server,
    redis_server_binary,
    start_celery_worker,
    wait_for,
)

from .app import IDLE_QUEUE, config
from .servers import ROOT, wait_ready

RABBITMQ_URL = os.environ.get("BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")
RABBITMQCTL = shlex.split(os.environ.get("BENCH_RABBITMQCTL") or "rabbitmqctl")
QUEUE = "bench-cluster"
TASKS = ("bench.read_only", "bench.idempotent_write", "bench.non_idempotent_write")


@dataclass
class NodeFigures:
    """One store node during one round."""

    address: str
    commands: int
    cpu_seconds: float
    keys: int
    #: How many streams of the global copy the node holds (one on a single
    #: Redis; a cluster's shards, store/keys.py).
    global_streams: int


@dataclass
class StoreRound:
    """One round: its store, its rate, its nodes."""

    store: str
    calls: int
    calls_per_second: float
    nodes: list[NodeFigures]

    @property
    def cpu_per_call_us(self) -> float:
        return sum(node.cpu_seconds for node in self.nodes) / self.calls * 1e6

    @property
    def busiest_cpu_per_call_us(self) -> float:
        return max(node.cpu_seconds for node in self.nodes) / self.calls * 1e6


def _rabbitmqctl(*arguments: str) -> None:
    subprocess.run([*RABBITMQCTL, "-q", *arguments], check=True, capture_output=True,
                   timeout=60)


@contextlib.contextmanager
def virtual_host() -> Iterator[str]:
    """A RabbitMQ virtual host of the run's own, as a broker URL."""
    user = urllib.parse.urlsplit(RABBITMQ_URL).username or "guest"
    vhost = f"bench-{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        yield f"{RABBITMQ_URL.rstrip('/')}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port < 55000:
            with contextlib.suppress(OSError):
                import socket

                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + 10000))
                return port
    raise RuntimeError("no free port pair for a cluster node")


@contextlib.contextmanager
def redis_cluster(nodes: int = 3) -> Iterator[list[int]]:
    """``nodes`` primaries (no replicas, no persistence) joined into a cluster: their ports."""
    if shutil.which("redis-cli") is None:
        raise SystemExit("redis-cli is not on PATH: it creates the cluster")
    workdir = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        ports = [_cluster_port() for _ in range(nodes)]
        for port in ports:
            folder = workdir / str(port)
            folder.mkdir()
            processes.append(subprocess.Popen(
                [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf"),
                 "--save", "", "--appendonly", "no", "--dir", str(folder)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in ports:
            wait_for(functools.partial(_pings, port), timeout=10, what=f"node {port}")
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(created.stdout + created.stderr)
        for port in ports:
            wait_for(functools.partial(_cluster_ok, port), timeout=30, what=f"node {port} ok")
        yield ports
    finally:
        for process in processes:
            process.kill()
            process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def _cluster_ok(port: int) -> bool:
    info: dict[str, Any] = redis.Redis(port=port).cluster("info")
    return info.get("cluster_state") == "ok"


def _node_state(port: int) -> tuple[int, float]:
    node = redis.Redis(port=port)
    stats: dict[str, Any] = node.info("stats")
    cpu: dict[str, Any] = node.info("cpu")
    return (int(stats["total_commands_processed"]),
            float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


def run_round(store: str, ports: list[int], *, broker: str, backend: str, calls: int,
              workers: int, concurrency: int, logs: Path) -> StoreRound:
    """Publish ``calls`` calls, let the workers run them on the store of
    ``ports`` (a cluster when ``store`` is ``cluster``); the round's figures."""
    clustered = store == "cluster"
    prefix = f"bc{uuid.uuid4().hex[:6]}:"
    store_url = f"redis://127.0.0.1:{ports[0]}/0"
    environment = dict(
        os.environ, BENCH_PREFIX=prefix, BENCH_BROKER=broker, BENCH_BACKEND=backend,
        BENCH_STORE=store_url, BENCH_PREFETCH="4", BENCH_BODY_SECONDS="0",
        BENCH_STORE_CLUSTER="1" if clustered else "0", BENCH_QUORUM_QUEUE=QUEUE,
        BENCH_VOLATILE="1", PYTHONPATH=str(ROOT))
    app = Celery(f"bench-cluster-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(config(prefix, broker, backend=backend, store=store_url,
                           store_cluster=clustered, quorum_queue=QUEUE, volatile=True))
    started = [start_celery_worker(
        "bench.app", logs / f"{store}-{index}.log", concurrency=concurrency,
        name=f"{store}{index}", wait=False, env=environment, queues=IDLE_QUEUE,
        loglevel="WARNING", root=ROOT) for index in range(workers)]
    try:
        wait_ready(app, started)
        warm = [app.send_task(TASKS[n % 3], args=[n], queue=QUEUE).id for n in range(30)]
        names = [worker.name for worker in started]
        app.control.add_consumer(QUEUE, destination=names, reply=True, timeout=5)
        results = redis.Redis.from_url(backend)
        _wait_results(results, prefix, warm, timeout=120)
        app.control.cancel_consumer(QUEUE, destination=names, reply=True, timeout=5)
        before = {port: _node_state(port) for port in ports}
        with app.producer_or_acquire() as producer:
            ids = [app.send_task(TASKS[n % 3], args=[n], queue=QUEUE, producer=producer).id
                   for n in range(calls)]
        app.control.add_consumer(QUEUE, destination=names, reply=True, timeout=5)
        done = _wait_results(results, prefix, ids, timeout=60 + calls * 0.1)
        after = {port: _node_state(port) for port in ports}
    finally:
        for worker in started:
            worker.stop(timeout=30)
    keys = store_keys(f"{prefix}te:", cluster=clustered)
    cluster = RedisCluster(host="127.0.0.1", port=ports[0]) if clustered else None
    holders = [int(cluster.get_node_from_key(stream).port)  # type: ignore[no-untyped-call]
               if cluster is not None else ports[0] for stream in keys.global_streams]
    nodes = [NodeFigures(
        address=f"127.0.0.1:{port}",
        # The two INFO reads of this program after the round are left out.
        commands=after[port][0] - before[port][0] - 2,
        cpu_seconds=after[port][1] - before[port][1],
        keys=int(redis.Redis(port=port).dbsize()),
        global_streams=holders.count(port)) for port in ports]
    span = max(done) - min(done)
    return StoreRound(store, calls, (calls - 1) / max(span, 1e-6), nodes)


def _wait_results(client: redis.Redis, prefix: str, ids: list[str],
                  timeout: float) -> list[float]:
    """Wait until every call of ``ids`` has a result; their ``date_done`` times."""
    keys = [f"{prefix}celery-task-meta-{task_id}" for task_id in ids]
    deadline = time.monotonic() + timeout
    while True:
        stored = [value for start in range(0, len(keys), 2000)
                  for value in client.mget(keys[start:start + 2000])]
        if all(value is not None for value in stored):
            break
        if time.monotonic() > deadline:
            missing = sum(value is None for value in stored)
            raise TimeoutError(f"{missing} results missing after {timeout:g}s")
        time.sleep(0.05)
    results = [json.loads(value) for value in stored if value is not None]
    failed = [result for result in results if result.get("status") != "SUCCESS"]
    if failed:
        raise RuntimeError(f"{len(failed)} calls did not succeed: {failed[:3]}")
    return [datetime.fromisoformat(str(result["date_done"])).timestamp() for result in results]


def report(rounds: list[StoreRound]) -> str:
    lines = ["| store | calls/s | store CPU per call | busiest node's CPU per call "
             "| that node saturates at |", "|---|---|---|---|---|"]
    for one in rounds:
        lines.append(f"| {one.store} | {one.calls_per_second:.0f} | {one.cpu_per_call_us:.0f} µs "
                     f"| {one.busiest_cpu_per_call_us:.0f} µs "
                     f"| ~{1e6 / max(one.busiest_cpu_per_call_us, 1e-9):,.0f} calls/s |")
    lines += ["", "| store | node | commands (scripts' included) | per call | CPU s | keys after "
              "| global streams |", "|---|---|---|---|---|---|---|"]
    for one in rounds:
        for node in one.nodes:
            lines.append(f"| {one.store} | {node.address} | {node.commands} "
                         f"| {node.commands / one.calls:.2f} | {node.cpu_seconds:.2f} "
                         f"| {node.keys} | {node.global_streams} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--stores", nargs="+", choices=("single", "cluster"),
                        default=["single", "cluster"])
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    rounds: list[StoreRound] = []
    with virtual_host() as broker, redis_server() as results, \
            tempfile.TemporaryDirectory() as logs:
        for store in args.stores:
            with contextlib.ExitStack() as stack:
                if store == "cluster":
                    ports = stack.enter_context(redis_cluster())
                else:
                    server = stack.enter_context(redis_server())
                    ports = [int(server.port)]
                rounds.append(run_round(store, ports, broker=broker, backend=results.url,
                                        calls=args.calls, workers=args.workers,
                                        concurrency=args.concurrency, logs=Path(logs)))
                print(report(rounds[-1:]), flush=True)
    print(f"\n{args.calls} calls (a third of each effect), {args.workers} worker(s) of "
          f"concurrency {args.concurrency}, RabbitMQ quorum queue, store without persistence")
    print(report(rounds))
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"store": one.store, "calls": one.calls, "calls_per_second": one.calls_per_second,
             "cpu_per_call_us": one.cpu_per_call_us,
             "nodes": [vars(node) for node in one.nodes]} for one in rounds], indent=2))


if __name__ == "__main__":
    main()
