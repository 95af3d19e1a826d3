"""Where a worker's time goes: py-spy on a ``celery worker`` under steady load.

Starts its own redis-server (one Redis for broker, result backend and store,
as the throughput rounds run), one prefork worker of ``bench.app``
(concurrency 2), keeps its queue full of calls of one variant, and records
every process of the worker with py-spy (``--subprocesses``, ``--idle`` off,
100 samples a second) for ``--seconds``. Prints, per process kind (the main
process, the pool processes), the share of samples whose stack holds each
part (a sample counts for every part on its stack), then the leaf functions
that take the most samples::

    python -m bench.profile --variant READ_ONLY --seconds 20
    python -m bench.profile --variant "NON_IDEMPOTENT_WRITE + deadline"

py-spy needs ptrace (root, or ``kernel.yama.ptrace_scope`` 0); it is in the
``bench`` extra.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import Counter
from pathlib import Path

from celery_tooleffect.testing import redis_server

from .app import IDLE_QUEUE, VARIANTS
from .calls import producer_app, publish
from .servers import wait_ready, worker_environment, workers

#: What a frame belongs to, by the path of its file (first match wins).
PARTS = (
    ("celery_tooleffect", "/celery_tooleffect/"),
    ("redis-py", "/redis/"),
    ("kombu", "/kombu/"),
    ("billiard", "/billiard/"),
    ("celery", "/celery/"),
)


def part_of(frame: str) -> str:
    """The part a py-spy frame (``function (path:line)``) belongs to."""
    for name, marker in PARTS:
        if marker in frame:
            return name
    return "other"


def summarize(raw: Path, main_pid: int, top: int = 15) -> str:
    """Shares by part and the hottest leaves, per process kind, from py-spy's
    ``raw`` output (one line per distinct stack: ``frames;...;leaf count``)."""
    totals: Counter[str] = Counter()
    parts: dict[str, Counter[str]] = {"main": Counter(), "pool": Counter()}
    leaves: dict[str, Counter[str]] = {"main": Counter(), "pool": Counter()}
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        # The first frame is the process: "process 123:\"celery ...\"".
        kind = "main" if frames[0].startswith(f"process {main_pid}:") else "pool"
        count = int(count_text)
        totals[kind] += count
        for part in {part_of(frame) for frame in frames[1:]}:
            parts[kind][part] += count
        leaves[kind][frames[-1]] += count
    out = []
    for kind in ("main", "pool"):
        if not totals[kind]:
            continue
        out.append(f"{kind} process{'es' if kind == 'pool' else ''}: {totals[kind]} samples")
        for part, count in parts[kind].most_common():
            out.append(f"  {part:18} {100 * count / totals[kind]:5.1f} %")
        out.append("  hottest leaves:")
        for leaf, count in leaves[kind].most_common(top):
            out.append(f"    {100 * count / totals[kind]:5.1f} %  {leaf}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="READ_ONLY", choices=list(VARIANTS))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--raw", type=Path, help="Keep py-spy's raw output here.")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    raw = args.raw or Path(tempfile.mkdtemp(prefix="tooleffect-profile-")) / "profile.txt"
    logdir = Path(tempfile.mkdtemp(prefix="tooleffect-profile-logs-"))
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"
    with redis_server(appendonly=True) as server:
        app = producer_app(prefix, server.url, with_results=False)
        environment = worker_environment(prefix, server.url)
        with workers(1, 2, environment, logdir, IDLE_QUEUE) as started:
            wait_ready(app, started)
            stop = threading.Event()

            def keep_the_queue_full() -> None:
                client = server.client(socket_timeout=30)
                while not stop.is_set():
                    if client.llen(f"{prefix}{IDLE_QUEUE}") < 2000:
                        publish(app, VARIANTS[args.variant], IDLE_QUEUE, 1000)
                    stop.wait(0.05)

            feeder = threading.Thread(target=keep_the_queue_full, daemon=True)
            feeder.start()
            try:
                stop.wait(3.0)  # warm: connections, scripts
                subprocess.run(
                    [py_spy, "record", "--pid", str(started[0].process.pid), "--subprocesses",
                     "--rate", "100", "--duration", str(int(args.seconds)), "--format", "raw",
                     "--output", str(raw), "--nonblocking"],
                    check=True, capture_output=True, timeout=args.seconds + 60,
                )
            finally:
                stop.set()
                feeder.join(30)
            main_pid = started[0].process.pid
    print(f"py-spy of one worker under {args.variant} load for {args.seconds:g} s "
          f"(raw: {raw})\n")
    print(summarize(raw, main_pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
