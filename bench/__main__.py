"""``python -m bench``: the price of safety, measured side by side with plain Celery.

Starts a private redis-server and real ``celery worker`` processes (prefork),
runs every phase, prints Markdown tables (as in ``bench/README.md``) and exits
non-zero if any call did not end as it should. ``--smoke`` runs a few hundred
calls and small data sets: it checks that the program works, and its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from celery import Celery

from celery_tooleffect.testing import RedisServer, redis_server
from tests.support import TcpProxy

from .app import BASELINE, FETCH, IDLE_QUEUE, VARIANTS, config, latency_queue
from .calls import (
    ONE_REDIS,
    CountingClient,
    Round,
    VariantFigures,
    latency_rounds,
    producer_app,
    round_trip_counts,
    throughput_rounds,
)
from .pools import add_options as add_matrix_options
from .pools import as_json as matrix_json
from .pools import describe as describe_matrix
from .pools import matrix_table, run_matrix
from .report import (
    calls_table,
    commands_detail,
    cpu_table,
    machine,
    operations_table,
    round_trips_table,
    summary_table,
    target_checks,
    targets_table,
)
from .servers import check_fetch, replicas_of, wait_ready, worker_environment, workers
from .store_scale import Timed, audit_read, dead_letter_operations

#: The peer row's database on the machine's PostgreSQL (trust authentication).
DBOS_URL = "postgresql://postgres@127.0.0.1:5432/tooleffect_bench_dbos"
#: Calls per throughput round of the peer row, at most (it is slower).
DBOS_CALLS = 2000

SMOKE = {
    "dbos": False, "rounds": 2, "calls": 100, "warmup": 20, "latency_rounds": 1,
    "latency_calls": 20,
    "rt_small": 40, "rt_large": 200, "letters": 2000, "replay": 200, "small_letters": 100,
    "global_events": 5000, "run_events": 100,
    # One cell of the pools matrix, two short rounds' worth.
    "pools": "threads", "bodies": "waiting", "deployments": "split", "matrix_rounds": 1,
    "matrix_seconds": 0.3, "matrix_waves": 2,
}
PHASES = ("calls", "round-trips", "dead-letters", "audit", "pools")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="A few hundred calls: checks the program works.")
    add("--phases", default=",".join(PHASES),
        help="Comma-separated phases to run (default: all). pools: the matrix of Celery's "
             "pools x bodies x deployments (bench/pools.py; its options below).")
    add("--rounds", type=int, default=5, help="Throughput rounds per variant.")
    add("--calls", type=int, default=5000, help="Calls per throughput round.")
    add("--warmup", type=int, default=1000, help="Calls of the discarded warm-up round.")
    add("--latency-rounds", type=int, default=5)
    add("--latency-calls", type=int, default=400, help="Calls per latency round.")
    add("--rt-small", type=int, default=100, help="Calls of the round trips' small batch.")
    add("--rt-large", type=int, default=600, help="Calls of the round trips' large batch.")
    add("--workers", type=int, default=1, help="celery worker processes.")
    add("--concurrency", type=int, default=2, help="Pool processes per worker.")
    add("--prefetch", type=int, default=4, help="worker_prefetch_multiplier.")
    add("--body-ms", type=float, default=0.0,
        help="Milliseconds each body waits, as a tool on its provider (default 0).")
    add("--letters", type=int, default=100_000, help="Dead letters stored.")
    add("--replay", type=int, default=10_000, help="READ_ONLY letters replayed in bulk.")
    add("--small-letters", type=int, default=1000,
        help="Letters stored when the CLI's memory is first measured.")
    add("--global-events", type=int, default=1_000_000)
    add("--run-events", type=int, default=1000)
    add("--replicas", type=int, default=0,
        help="Replicas of the run's redis-server (started by the run).")
    add("--store-replicas", type=int, default=0,
        help="tooleffect_store_replicas: replicas each journal write waits for (WAIT).")
    add("--no-appendonly", dest="appendonly", action="store_false",
        help="Run Redis without AOF (default: AOF, fsync every second); the workers "
             "accept it with tooleffect_allow_volatile_store.")
    add("--appendfsync", choices=("everysec", "always"), default="everysec",
        help="The AOF's fsync policy (default everysec).")
    add("--json", type=Path, help="Also write every figure to this JSON file.")
    add("--dbos-url", default=DBOS_URL,
        help="PostgreSQL database (created and dropped) of the DBOS Transact peer row.")
    add("--no-dbos", dest="dbos", action="store_false",
        help="Leave out the DBOS Transact peer row.")
    add_matrix_options(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


def persistence(args: argparse.Namespace) -> str:
    """The run's Redis persistence, in words."""
    if not args.appendonly:
        return "no persistence (tooleffect_allow_volatile_store)"
    return f"AOF, appendfsync {args.appendfsync}"


def counting_proxy(port: int) -> TcpProxy:
    """A proxy in front of the run's redis-server that counts round trips (it
    outlives the longest run: 30 minutes)."""
    return TcpProxy(port, lifetime=1800.0, max_connections=256)


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def dbos_peer(args: argparse.Namespace) -> tuple[VariantFigures | None, str]:
    """The DBOS Transact row (``bench/dbos_peer.py``, its own process), or None
    and why it was left out."""
    if not args.dbos:
        return None, "left out (--no-dbos)"
    if importlib.util.find_spec("dbos") is None:
        return None, "skipped: dbos is not installed (pip install -e '.[bench]')"
    address = sqlalchemy_address(args.dbos_url)
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError as exc:
        return None, f"skipped: no PostgreSQL answers at {address[0]}:{address[1]} ({exc})"
    calls = min(args.calls, DBOS_CALLS)
    done = subprocess.run(
        [sys.executable, "-m", "bench.dbos_peer", args.dbos_url, "--calls", str(calls),
         "--rounds", str(args.rounds), "--warmup", str(min(args.warmup, calls)),
         "--latency-calls", str(args.latency_calls), "--body-ms", repr(args.body_ms)],
        capture_output=True, text=True, timeout=1800, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the DBOS peer failed:\n{done.stderr[-3000:]}")
    peer = json.loads(done.stdout.strip().splitlines()[-1])
    figure = VariantFigures(f"DBOS Transact {peer['version']} step (PostgreSQL, queued)")
    figure.rounds = [Round(figure.variant, calls, (calls - 1) / rate) for rate in peer["rounds"]]
    figure.latencies_ms = list(peer["latencies_ms"])
    return figure, f"{calls:,} calls per round"


def sqlalchemy_address(url: str) -> tuple[str, int]:
    """Host and port of a ``postgresql://`` URL."""
    parsed = urllib.parse.urlsplit(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 5432


def call_phases(args: argparse.Namespace, server: RedisServer, phases: set[str],
                logdir: Path) -> dict[str, VariantFigures]:
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    figures = {variant: VariantFigures(variant) for variant in VARIANTS}
    poller = CountingClient(server.client(socket_timeout=60))
    quiet = producer_app(prefix, server.url, with_results=False)
    # The fetches, the baseline's (kombu's) first, and the variants each runs.
    fetches = list(dict.fromkeys(FETCH.values()))
    if "calls" in phases:
        # One group of workers per fetch, all running through the rounds, so
        # that the rounds interleave every variant as they would on one worker.
        with contextlib.ExitStack() as stack:
            groups = {}
            for fetch in fetches:
                environment = worker_environment(prefix, server.url, prefetch=args.prefetch,
                                                 body_seconds=args.body_ms / 1000.0,
                                                 store_replicas=args.store_replicas,
                                                 fetch=fetch)
                groups[fetch] = stack.enter_context(workers(
                    args.workers, args.concurrency, environment, logdir,
                    f"{IDLE_QUEUE},{latency_queue(fetch)}", name=fetch))
            for fetch, started in groups.items():
                wait_ready(quiet, started)
                check_fetch(started, fetch)
            throughput_rounds(quiet, groups, prefix, poller, figures, rounds=args.rounds,
                              calls=args.calls, warmup=args.warmup, progress=say)
            latency_rounds(producer_app(prefix, server.url, with_results=True), figures,
                           rounds=args.latency_rounds, calls=args.latency_calls, progress=say)
    if "round-trips" in phases:
        def count(proxies: dict[str, TcpProxy], one_redis: bool) -> None:
            urls = {role: proxy.url() for role, proxy in proxies.items()}
            # One fetch's workers at a time: only the workers that run the
            # counted calls may reach Redis through the proxies.
            for fetch in fetches:
                environment = worker_environment(
                    prefix, urls.get("broker", urls.get(ONE_REDIS, "")),
                    backend=urls.get("backend", urls.get(ONE_REDIS)),
                    store=urls.get("store", urls.get(ONE_REDIS)), prefetch=args.prefetch,
                    store_replicas=args.store_replicas, fetch=fetch)
                with workers(args.workers, args.concurrency, environment, logdir,
                             IDLE_QUEUE, name=fetch) as started:
                    wait_ready(quiet, started)
                    check_fetch(started, fetch)
                    round_trip_counts(
                        quiet, [worker.name for worker in started], prefix, poller,
                        server.client(socket_timeout=60), proxies, figures,
                        small=args.rt_small, large=args.rt_large, progress=say,
                        one_redis=one_redis,
                        variants={variant: task for variant, task in VARIANTS.items()
                                  if FETCH[variant] == fetch})

        with counting_proxy(server.port) as broker, counting_proxy(server.port) as backend, \
                counting_proxy(server.port) as store:
            count({"broker": broker, "backend": backend, "store": store}, one_redis=False)
        # The common deployment: one Redis for all three, as the throughput
        # rounds run. The package then stores Celery's result, the broker lease
        # and a successful call's acknowledgement in its own scripts, so only
        # the total can be counted.
        with counting_proxy(server.port) as one:
            count({ONE_REDIS: one}, one_redis=True)
    return figures


def store_phases(args: argparse.Namespace, server: RedisServer,
                 phases: set[str]) -> list[Timed]:
    timed: list[Timed] = []
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    global_maxlen = max(args.global_events, 100_000)
    app = Celery("bench-operator", set_as_current=False)
    app.conf.update(config(prefix, server.url, global_maxlen=global_maxlen))
    environment = worker_environment(prefix, server.url)
    if "dead-letters" in phases:
        timed += dead_letter_operations(app, environment, letters_count=args.letters,
                                        replay_count=args.replay,
                                        small_count=args.small_letters, progress=say)
    if "audit" in phases:
        timed += audit_read(app, environment, global_events=args.global_events,
                            run_events=args.run_events, progress=say)
    return timed


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    phases = {phase.strip() for phase in args.phases.split(",") if phase.strip()}
    unknown = phases - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phase(s): {', '.join(sorted(unknown))}")
    logdir = Path(tempfile.mkdtemp(prefix="tooleffect-bench-"))
    say(f"worker logs in {logdir}")
    started = time.monotonic()
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict[str, Any] = {"machine": machine(), "command": command.strip()}
    sections = [f"Machine: {results['machine']}", f"Command: `{results['command']}`",
                f"Redis: {persistence(args)}"
                f", {args.replicas} replica(s), tooleffect_store_replicas {args.store_replicas}"
                f"; workers: {args.workers} x prefork concurrency {args.concurrency}, "
                f"prefetch multiplier {args.prefetch}; body: "
                + (f"waits {args.body_ms:g} ms" if args.body_ms else "returns at once")]
    if args.store_replicas > args.replicas:
        raise SystemExit("--store-replicas cannot exceed --replicas")
    # The workers (started below, with this environment) accept a Redis that
    # keeps nothing on disk only when the run asks for one.
    os.environ["BENCH_VOLATILE"] = "0" if args.appendonly else "1"
    fsync = ("--appendfsync", args.appendfsync)
    if phases & {"calls", "round-trips"}:
        with redis_server(*fsync, appendonly=args.appendonly) as server, \
                replicas_of(server, args.replicas):
            figures = call_phases(args, server, phases, logdir)
        results["variants"] = {name: asdict(figure) for name, figure in figures.items()}
        peer: VariantFigures | None = None
        if "calls" in phases:
            peer, peer_note = dbos_peer(args)
            say(f"DBOS Transact row: {peer_note}")
            if peer is not None:
                results["dbos"] = asdict(peer)
        checks = target_checks(figures, body_ms=args.body_ms)
        results["targets"] = [asdict(check) for check in checks]
        sections.append(
            f"Side by side (baseline: {BASELINE}; every other Celery row fetches with the "
            "package's atomic fetch; round trips from fetch to acknowledgement with broker, "
            "result backend and store on one Redis; calls/s the median round; CPU all "
            "processes' microseconds per call)\n\n"
            + summary_table(figures, peer)
            + "\n\nTargets (reported, not asserted)\n\n" + targets_table(checks))
        if "calls" in phases:
            sections.append(f"Throughput: median of {args.rounds} rounds of {args.calls:,} "
                            f"calls; latency: {args.latency_rounds} rounds of "
                            f"{args.latency_calls} calls, one at a time, publish to "
                            f"date_done. DBOS Transact row: {peer_note}\n\n"
                            + calls_table(figures, peer)
                            + "\n\nCPU microseconds per call in the throughput rounds "
                            "(median; in brackets: more than the baseline)\n\n"
                            + cpu_table(figures))
        if "round-trips" in phases:
            sections.append(f"Round trips and Redis commands per successful call "
                            f"(batches of {args.rt_small} and {args.rt_large})\n\n"
                            + round_trips_table(figures) + "\n\n" + commands_detail(figures))
    if phases & {"dead-letters", "audit"}:
        with redis_server(*fsync, appendonly=args.appendonly) as server:
            timed = store_phases(args, server, phases)
        results["operations"] = [asdict(entry) for entry in timed]
        sections.append(f"Operator commands ({args.letters:,} dead letters; audit: "
                        f"{args.global_events:,} events in the global stream)\n\n"
                        + operations_table(timed))
    if "pools" in phases:
        matrix_started = time.monotonic()
        cells = run_matrix(args, logdir, say)
        results["pools"] = matrix_json(cells)
        sections.append(f"Pools matrix ({describe_matrix()} Took "
                        f"{time.monotonic() - matrix_started:.0f} s.)\n\n" + matrix_table(cells))
    sections.append(f"Took {time.monotonic() - started:.0f} s.")
    print("\n\n".join(sections))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
