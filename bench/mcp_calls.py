"""``python -m bench.mcp_calls``: a call through the MCP server, beside the same
call made directly with ``apply_async``, in one run.

Starts a private redis-server (AOF, fsync every second, as ``python -m bench``),
one ``celery -A bench.app worker`` (prefork, concurrency 2) and the package's
MCP server (``celery -A bench.app tooleffect mcp``) twice: over stdio (its
subprocess) and over streamable HTTP on a loopback port. For a READ_ONLY and a
NON_IDEMPOTENT_WRITE tool of ``bench.app`` (a body that returns its argument)
it measures, interleaved round by round:

- **direct**: ``task.apply_async((n,)).get()`` from this process, as a Python
  agent runtime that imports the app calls a tool;
- **MCP stdio** and **MCP HTTP**: ``ClientSession.call_tool`` of the ``mcp``
  SDK's client, each call with an ``idempotencyKey`` (what a client that may
  resend sends: one more round trip, the id's claim), so the direct row
  passes a ``call_id=`` as well.

Latency: calls one at a time, p50 and p99 of each call's wall time, and the
difference to direct. Throughput: ``--concurrency`` calls in flight at once
(threads for direct, tasks on one session for MCP), calls per second of the
whole round. Every call must answer SUCCESS with its argument, or the run
exits non-zero. ``--smoke`` makes a few calls: it checks that the program
works, and its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import anyio
import httpx2
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import RequestParamsMeta

from celery_tooleffect.testing import free_port, redis_server, wait_for

from .app import IDLE_QUEUE, config
from .app import app as bench_app
from .report import machine
from .servers import ROOT, wait_ready, worker_environment, workers

TOOLS = {"READ_ONLY": "bench.read_only", "NON_IDEMPOTENT_WRITE": "bench.non_idempotent_write"}
PATHS = ("direct", "MCP stdio", "MCP HTTP")

#: One call: its argument -> its result (raises if it did not succeed).
Caller = Callable[[int], Awaitable[Any]]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.mcp_calls",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000,
                        help="calls per latency round (one at a time; default 1000)")
    parser.add_argument("--throughput-calls", type=int, default=2000,
                        help="calls per throughput round (default 2000)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="calls in flight in a throughput round (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3)")
    parser.add_argument("--smoke", action="store_true", help="a few calls: the program works")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls, args.throughput_calls, args.rounds, args.concurrency = 10, 20, 1, 4
    return args


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class Figures:
    """One path and tool: each latency (s) and each throughput round's rate."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.rates: list[float] = []

    def summary(self) -> dict[str, float]:
        return {"calls_per_s": statistics.median(self.rates),
                "p50_ms": percentile(self.latencies, 50) * 1000,
                "p99_ms": percentile(self.latencies, 99) * 1000}


async def latency_round(call: Caller, calls: int, figures: Figures) -> None:
    for n in range(calls):
        started = time.perf_counter()
        assert await call(n) == n
        figures.latencies.append(time.perf_counter() - started)


async def throughput_round(call: Caller, calls: int, concurrency: int,
                           figures: Figures) -> None:
    limit = anyio.Semaphore(concurrency)

    async def one(n: int) -> None:
        async with limit:
            assert await call(n) == n

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for n in range(calls):
            group.start_soon(one, n)
    figures.rates.append(calls / (time.perf_counter() - started))


def mcp_caller(session: ClientSession, tool: str) -> Caller:
    async def call(n: int) -> Any:
        meta = cast(RequestParamsMeta, {"idempotencyKey": uuid.uuid4().hex})
        result = await session.call_tool(tool, {"n": n}, meta=meta)
        content = result.structured_content or {}
        if result.is_error or content.get("status") != "succeeded":
            raise RuntimeError(f"{tool}({n}) did not succeed: {content}")
        return content["result"]
    return call


def direct_caller(app: Any, tool: str) -> Caller:
    task = app.tasks[tool]

    def blocking(n: int) -> Any:
        return task.apply_async((n,), call_id=uuid.uuid4().hex).get(timeout=60)

    async def call(n: int) -> Any:
        return await anyio.to_thread.run_sync(blocking, n)
    return call


async def measure(args: argparse.Namespace, app: Any, env: dict[str, str], url: str,
                  token: str) -> dict[tuple[str, str], Figures]:
    figures = {(path, effect): Figures() for path in PATHS for effect in TOOLS}
    stdio = StdioServerParameters(
        command=sys.executable, args=["-m", "celery", "-A", "bench.app", "tooleffect", "mcp"],
        env=env, cwd=str(ROOT))
    async with stdio_client(stdio) as (read, write), ClientSession(read, write) as over_stdio, \
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                               timeout=httpx2.Timeout(30, read=120)) as http, \
            streamable_http_client(url, http_client=http) as (hread, hwrite), \
            ClientSession(hread, hwrite) as over_http:
        await over_stdio.initialize()
        await over_http.initialize()
        callers = {}
        for effect, tool in TOOLS.items():
            callers[("direct", effect)] = direct_caller(app, tool)
            callers[("MCP stdio", effect)] = mcp_caller(over_stdio, tool)
            callers[("MCP HTTP", effect)] = mcp_caller(over_http, tool)
        for call in callers.values():  # warm up every path: connections, imports
            for n in range(5):
                assert await call(n) == n
        for _ in range(args.rounds):
            for key, call in callers.items():
                await latency_round(call, args.calls, figures[key])
            for key, call in callers.items():
                await throughput_round(call, args.throughput_calls, args.concurrency,
                                       figures[key])
    return figures


def table(figures: dict[tuple[str, str], Figures], concurrency: int) -> str:
    lines = [f"| path | tool | calls/s ({concurrency} in flight) | vs direct | p50 ms | "
             "p99 ms | added p50 ms | added p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for effect in TOOLS:
        base = figures[("direct", effect)].summary()
        for path in PATHS:
            row = figures[(path, effect)].summary()
            lines.append(
                f"| {path} | {effect} | {row['calls_per_s']:.0f} | "
                f"{row['calls_per_s'] / base['calls_per_s']:.3f} | {row['p50_ms']:.2f} | "
                f"{row['p99_ms']:.2f} | {row['p50_ms'] - base['p50_ms']:+.2f} | "
                f"{row['p99_ms'] - base['p99_ms']:+.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    token = uuid.uuid4().hex
    logdir = Path(tempfile.mkdtemp(prefix="bench-mcp-"))
    with redis_server(appendonly=True) as server:
        env = worker_environment(prefix, server.url)
        # The direct calls are made by bench.app's own tasks (ToolTask's
        # apply_async), pointed at this run's server before anything reads it.
        app = bench_app
        app.conf.update(config(prefix, server.url))
        port = free_port()
        with workers(1, 2, env, logdir, IDLE_QUEUE) as started, \
                open(logdir / "mcp-http.log", "wb") as http_log:
            wait_ready(app, started)
            http_server = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bench.app", "tooleffect", "mcp",
                 "--transport", "streamable-http", "--port", str(port),
                 "--token-env", "BENCH_MCP_TOKEN"],
                env={**env, "BENCH_MCP_TOKEN": token}, cwd=str(ROOT), stdout=http_log,
                stderr=subprocess.STDOUT)
            try:
                wait_for(lambda: _listens(port) or http_server.poll() is not None,
                         timeout=30, what="the MCP server to listen")
                if http_server.poll() is not None:
                    raise RuntimeError((logdir / "mcp-http.log").read_text())
                figures = anyio.run(measure, args, app, env,
                                    f"http://127.0.0.1:{port}/mcp", token)
            finally:
                http_server.terminate()
                http_server.wait(10)
    print(f"## A call through the MCP server beside apply_async ({machine()})\n")
    print(table(figures, args.concurrency))
    if args.json:
        args.json.write_text(json.dumps(
            {f"{path} / {effect}": {**item.summary(), "latencies": item.latencies,
                                     "rates": item.rates}
             for (path, effect), item in figures.items()}, indent=2))
    return 0


def _listens(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
