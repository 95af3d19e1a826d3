"""The pools matrix: every Celery pool x body x deployment, beside plain Celery.

```sh
.venv/bin/python -m bench --phases pools            # the whole matrix (part of make bench)
.venv/bin/python -m bench.pools                     # the same, alone (options: --help)
.venv/bin/python -m bench.pools --pools threads --bodies waiting --deployments split
```

Cells: the pools prefork (concurrency 2), threads (20) and gevent (50), each
at the ``worker_prefetch_multiplier`` the package's start-up check recommends
there (1, 1 and 4: ``celery_tooleffect.worker.startup.prefetch_advice``);
bodies that return at once (``trivial``) or wait 0.1 s as a tool waits on its
provider (``waiting``); and two deployments of one redis-server of the run's
own (AOF, fsync every second): ``one database`` (broker, results and store in
database 0) and ``split databases`` (broker in 0, results and store in 1:
Celery's documented pattern). ``broker_pool_limit`` and the Redis
transport's ``max_connections`` are raised past the concurrency: plain Celery
on gevent otherwise fails its acknowledgements with ``MaxConnectionsError``
(kombu's 10 connections).

In each cell, two ``celery -A bench.app worker --pool <pool>`` processes run
at once, one with kombu's fetch for plain Celery (the baseline,
``bench.plain`` with ``acks_late``), one with the package's atomic fetch for
the tools. Variants are interleaved round by round (one warm-up round each,
discarded), each round publishing its calls to a queue of its own that the
worker of its fetch then consumes. A round's rate is ``(N - 1) / (last
date_done - first date_done)`` (the workers' own timestamps); a variant's
figure is its median round. **p99**: the calls are then sent in waves of the
pool's concurrency (the next wave once all of one are done), and a call's
latency runs from just before its publish to its ``date_done``: the latency
of a call on a pool that is busy but not queueing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_tooleffect.testing import (
    RedisServer,
    WorkerProcess,
    redis_server,
    start_celery_worker,
    wait_for,
)

from .app import ATOMIC, KOMBU, config
from .calls import _chunks, _done_at, publish
from .servers import ROOT, check_fetch, wait_ready, worker_environment

#: Each pool's concurrency and the prefetch multiplier recommended there.
POOLS = {"prefork": (2, 1), "threads": (20, 1), "gevent": (50, 4)}
#: Seconds each body waits.
BODIES = {"trivial": 0.0, "waiting": 0.1}
#: Where broker, results and store live on the run's one redis-server:
#: (broker database, results and store database).
DEPLOYMENTS = {"one database": (0, 0), "split databases": (0, 1)}
#: What the short names of the options stand for.
SHORT = {"one": "one database", "split": "split databases"}

BASELINE = "plain Celery"
#: The variants, baseline first: their task and the fetch of their worker.
VARIANTS = {
    BASELINE: ("bench.plain", KOMBU),
    "READ_ONLY": ("bench.read_only", ATOMIC),
    "IDEMPOTENT_WRITE": ("bench.idempotent_write", ATOMIC),
    "NON_IDEMPOTENT_WRITE": ("bench.non_idempotent_write", ATOMIC),
    "NON_IDEMPOTENT_WRITE + deadline": ("bench.non_idempotent_deadline", ATOMIC),
}
WRITES = ("IDEMPOTENT_WRITE", "NON_IDEMPOTENT_WRITE")
DEADLINE = "NON_IDEMPOTENT_WRITE + deadline"


def targets(pool: str, body: str, deployment: str) -> dict[str, float]:
    """The least ratio to plain Celery of each variant in a cell (issue 39;
    none where the issue sets none: trivial bodies on threads and gevent)."""
    if body == "waiting":
        # I/O-bound tools on every pool and deployment.
        return {variant: 0.95 for variant in VARIANTS if variant != BASELINE}
    if pool != "prefork":
        return {}
    if deployment == "one database":
        return {"READ_ONLY": 1.00, **{write: 0.95 for write in WRITES}, DEADLINE: 0.90}
    return {"READ_ONLY": 1.00, **{write: 0.90 for write in WRITES}, DEADLINE: 0.90}


@dataclass
class Cell:
    """The figures of one cell: per variant, each round's calls/s and every
    call's latency (ms) in the waves."""

    pool: str
    body: str
    deployment: str
    concurrency: int
    prefetch: int
    rates: dict[str, list[float]] = field(default_factory=dict)
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)

    def rate(self, variant: str) -> float:
        return statistics.median(self.rates[variant]) if self.rates.get(variant) else 0.0

    def ratio(self, variant: str) -> float:
        base = self.rate(BASELINE)
        return self.rate(variant) / base if base else float("nan")

    def p99(self, variant: str) -> float:
        taken = sorted(self.latencies_ms.get(variant) or [])
        if not taken:
            return float("nan")
        return taken[min(len(taken) - 1, round(0.99 * (len(taken) - 1)))]

    def checks(self) -> dict[str, tuple[float, bool]]:
        """Each target of the cell: its least ratio and whether it is met."""
        return {variant: (least, self.ratio(variant) >= least)
                for variant, least in targets(self.pool, self.body, self.deployment).items()}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The matrix's options (shared by ``python -m bench`` and ``bench.pools``)."""
    add = parser.add_argument
    add("--pools", default=",".join(POOLS), help="Comma-separated pools of the matrix.")
    add("--bodies", default=",".join(BODIES), help="Comma-separated bodies (trivial, waiting).")
    add("--deployments", default="one,split",
        help="Comma-separated deployments (one: one database; split: broker in db 0, "
             "results and store in db 1).")
    add("--matrix-rounds", type=int, default=3, help="Rounds per variant in a cell.")
    add("--matrix-seconds", type=float, default=3.0,
        help="About how long a round lasts: its calls are sized from a first estimate.")
    add("--matrix-waves", type=int, default=0,
        help="Waves of the p99 (default: enough for 200 calls).")


def chosen(value: str, known: Sequence[str], option: str) -> list[str]:
    names = [SHORT.get(name.strip(), name.strip()) for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def database_url(server: RedisServer, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


@contextlib.contextmanager
def cell_workers(prefix: str, server: RedisServer, pool: str, body: str, deployment: str,
                 logdir: Path) -> Iterator[dict[str, WorkerProcess]]:
    """The two workers of a cell (kombu's fetch, the atomic fetch), running."""
    concurrency, prefetch = POOLS[pool]
    broker_db, store_db = DEPLOYMENTS[deployment]
    broker, results = database_url(server, broker_db), database_url(server, store_db)
    started: dict[str, WorkerProcess] = {}
    try:
        for fetch in (KOMBU, ATOMIC):
            env = worker_environment(prefix, broker, backend=results, store=results,
                                     prefetch=prefetch, body_seconds=BODIES[body], fetch=fetch)
            env["BENCH_POOL_LIMIT"] = str(max(10, concurrency + 2))
            name = f"m{pool[:2]}{body[:1]}{store_db}{fetch[:1]}-{uuid.uuid4().hex[:4]}"
            started[fetch] = start_celery_worker(
                "bench.app", logdir / f"{name}.log", pool=pool, concurrency=concurrency,
                name=name, wait=False, env=env, queues=f"bench-idle-{fetch}",
                loglevel="WARNING", root=ROOT)
        yield started
    finally:
        for worker in started.values():
            worker.stop(timeout=30)


def drain(app: Celery, worker: WorkerProcess, queue: str, ids: list[str], prefix: str,
          queues: redis.Redis, results: redis.Redis, timeout: float) -> list[dict[str, Any]]:
    """Let ``worker`` consume ``queue`` until every call has its SUCCESS result
    (``queues``: the broker's database; ``results``: the backend's)."""
    replies = app.control.add_consumer(queue, destination=[worker.name], reply=True, timeout=5)
    if len(replies or []) != 1:
        raise RuntimeError(f"{worker.name} does not consume {queue}: {replies}")
    try:
        return collect(ids, prefix, results, timeout, queue_length=lambda: int(
            queues.llen(f"{prefix}{queue}")))
    finally:
        app.control.cancel_consumer(queue, destination=[worker.name], reply=True, timeout=5)


def collect(ids: list[str], prefix: str, results: redis.Redis, timeout: float,
            queue_length: Callable[[], int] = lambda: 0) -> list[dict[str, Any]]:
    """The stored results of ``ids`` once all are there; raises unless each
    is SUCCESS."""
    deadline = time.monotonic() + timeout
    keys = [f"{prefix}celery-task-meta-{task_id}" for task_id in ids]
    while queue_length() > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"queue not drained in {timeout:g}s")
        time.sleep(0.05)
    while True:
        stored = [value for chunk in _chunks(keys, 5000) for value in results.mget(chunk)]
        if all(value is not None for value in stored):
            break
        if time.monotonic() > deadline:
            missing = sum(value is None for value in stored)
            raise TimeoutError(f"{missing} results missing after {timeout:g}s")
        time.sleep(0.01)
    found = [json.loads(value) for value in stored if value is not None]
    failed = [result for result in found if result.get("status") != "SUCCESS"]
    if failed:
        raise RuntimeError(f"{len(failed)} calls did not succeed: {failed[:3]}")
    return found


def run_cell(prefix: str, server: RedisServer, pool: str, body: str, deployment: str,
             args: argparse.Namespace, logdir: Path, say: Callable[[str], None]) -> Cell:
    concurrency, prefetch = POOLS[pool]
    broker_db, store_db = DEPLOYMENTS[deployment]
    cell = Cell(pool, body, deployment, concurrency, prefetch)
    app = Celery(f"bench-matrix-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(config(prefix, database_url(server, broker_db)))
    app.conf.result_backend = None  # the producer subscribes to nothing
    queues = server.client(db=broker_db, socket_timeout=60)
    results = server.client(db=store_db, socket_timeout=60)
    with cell_workers(prefix, server, pool, body, deployment, logdir) as started:
        wait_ready(app, list(started.values()))
        for fetch, worker in started.items():
            check_fetch([worker], fetch)
        # Calls per round: from the warm-up's rate, for rounds of about
        # --matrix-seconds (at least two waves of the pool's concurrency).
        warmup = max(2 * concurrency, 20)
        sizes: dict[str, int] = {}
        for number in range(-1, args.matrix_rounds):
            for variant, (task_name, fetch) in VARIANTS.items():
                size = warmup if number < 0 else sizes[variant]
                queue = f"bench-matrix-{uuid.uuid4().hex[:8]}"
                ids = publish(app, task_name, queue, size)
                found = drain(app, started[fetch], queue, ids, prefix, queues, results,
                              timeout=120 + size * max(BODIES[body], 0.01))
                done = sorted(_done_at(result) for result in found)
                rate = (size - 1) / max(done[-1] - done[0], 1e-6)
                if number < 0:
                    sizes[variant] = max(2 * concurrency, int(rate * args.matrix_seconds))
                    continue
                cell.rates.setdefault(variant, []).append(rate)
        waves = args.matrix_waves or max(2, -(-200 // concurrency))
        for variant, (task_name, fetch) in VARIANTS.items():
            queue = f"bench-matrix-{uuid.uuid4().hex[:8]}"
            app.control.add_consumer(queue, destination=[started[fetch].name], reply=True,
                                     timeout=5)
            try:
                taken: list[float] = []
                for _ in range(waves):
                    sent: dict[str, float] = {}
                    with app.producer_or_acquire() as producer:
                        for number in range(concurrency):
                            at = time.time()
                            sent[app.send_task(task_name, args=[number], queue=queue,
                                               producer=producer).id] = at
                    for result in collect(list(sent), prefix, results, timeout=60):
                        taken.append((_done_at(result) - sent[result["task_id"]]) * 1000.0)
                cell.latencies_ms[variant] = taken
            finally:
                app.control.cancel_consumer(queue, destination=[started[fetch].name],
                                            reply=True, timeout=5)
    say(f"{pool} / {body} / {deployment}: " + ", ".join(
        f"{variant} {cell.rate(variant):,.0f}/s ({cell.ratio(variant):.2f}) "
        f"p99 {cell.p99(variant):.1f} ms" for variant in VARIANTS))
    return cell


def run_matrix(args: argparse.Namespace, logdir: Path,
               say: Callable[[str], None]) -> list[Cell]:
    """Every chosen cell, on one redis-server of the run's own (AOF unless
    ``args.appendonly`` is false)."""
    pools = chosen(args.pools, list(POOLS), "--pools")
    bodies = chosen(args.bodies, list(BODIES), "--bodies")
    deployments = chosen(args.deployments, list(DEPLOYMENTS), "--deployments")
    if "gevent" in pools and importlib.util.find_spec("gevent") is None:
        raise SystemExit("the gevent pool needs gevent: pip install -e '.[bench]'")
    cells = []
    appendonly = getattr(args, "appendonly", True)
    with redis_server("--appendfsync", getattr(args, "appendfsync", "everysec"),
                      appendonly=appendonly) as server:
        wait_for(lambda: bool(server.client().ping()), timeout=10, what="redis")
        for pool in pools:
            for body in bodies:
                for deployment in deployments:
                    prefix = f"bm{uuid.uuid4().hex[:6]}:"
                    cells.append(run_cell(prefix, server, pool, body, deployment, args,
                                          logdir, say))
    return cells


def matrix_table(cells: Sequence[Cell]) -> str:
    """One row per cell; per variant: calls/s, the ratio to plain Celery (a
    target met ✓, missed ✗) and p99 in ms."""
    headers = ["pool (concurrency, prefetch)", "body", "deployment", *VARIANTS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for cell in cells:
        checks = cell.checks()
        row = [f"{cell.pool} ({cell.concurrency}, {cell.prefetch})", cell.body, cell.deployment]
        for variant in VARIANTS:
            mark = ""
            if variant in checks:
                least, met = checks[variant]
                mark = f" {'✓' if met else '✗'}≥{least:.2f}"
            ratio = "" if variant == BASELINE else f" · {cell.ratio(variant):.2f}{mark}"
            row.append(f"{cell.rate(variant):,.0f}/s{ratio} · p99 {cell.p99(variant):.0f} ms")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def as_json(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Every figure of the cells, with their medians, ratios, p99 and targets."""
    return [dict(asdict(cell), summary={
        variant: {"calls_per_s": cell.rate(variant), "ratio": cell.ratio(variant),
                  "p99_ms": cell.p99(variant),
                  **({"target": cell.checks()[variant][0], "met": cell.checks()[variant][1]}
                     if variant in cell.checks() else {})}
        for variant in VARIANTS}) for cell in cells]


def describe() -> str:
    return ("Pools x bodies x deployments, one redis-server (AOF), beside plain Celery "
            "(kombu's fetch, acks_late) in the same run. Each cell: calls/s (median "
            "round) · ratio to plain Celery (✓/✗ the issue's least ratio) · p99 of calls "
            "sent in waves of the pool's concurrency.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pools",
                                     description=__doc__.split("\n\n", 1)[0])
    add_options(parser)
    parser.add_argument("--json", type=Path, help="Also write every figure to this file.")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        logdir = Path(stack.enter_context(_tempdir()))
        cells = run_matrix(args, logdir, lambda line: print(line, file=sys.stderr, flush=True))
    print(describe() + "\n\n" + matrix_table(cells)
          + f"\n\nTook {time.monotonic() - started:.0f} s.")
    if args.json:
        args.json.write_text(json.dumps(as_json(cells), indent=2))
    return 0


@contextlib.contextmanager
def _tempdir() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tooleffect-pools-") as logs:
        yield logs


if __name__ == "__main__":
    sys.exit(main())
