"""Where a worker's time goes: py-spy on a ``celery worker`` under steady load.

Starts its own redis-server (one Redis for broker, result backend and store,
as the throughput rounds run), one prefork worker of ``bench.app``
(concurrency 2), keeps its queue full of calls of one variant, and records
every process of the worker with py-spy (``--subprocesses``, ``--idle`` off,
100 samples a second) for ``--seconds``. Prints, per process kind (the main
process, the pool processes), the share of samples whose stack holds each
part, the share under the package's code and the functions that take the
most samples::

    python -m bench.profile --variant READ_ONLY --seconds 20
    python -m bench.profile --variant "NON_IDEMPOTENT_WRITE + deadline"
    python -m bench.profile --variant "plain celery, kombu's fetch"

The worker fetches as the variant's row of ``python -m bench`` does
(``bench.app.FETCH``: kombu's own fetch for the baseline, else the atomic one).

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

from .app import FETCH, IDLE_QUEUE, VARIANTS
from .calls import producer_app, publish
from .servers import check_fetch, wait_ready, worker_environment, workers

#: What a frame belongs to, by the path py-spy prints (first match wins).
PARTS = (
    ("celery_tooleffect", "(celery_tooleffect/"),
    ("redis-py", "(redis/"),
    ("kombu", "(kombu/"),
    ("billiard", "(billiard/"),
    ("celery", "(celery/"),
)


def part_of(frame: str) -> str:
    """The part a py-spy frame (``function (path:line)``) belongs to."""
    for name, marker in PARTS:
        if marker in frame:
            return name
    return "other (standard library, json, ...)"


def summarize(raw: Path, top: int = 12) -> str:
    """From py-spy's ``raw`` output (one line per distinct stack, ``frames;...;leaf
    count``, each process's stack under ``process PID:...`` frames, a pool
    process's under its parent's), per process kind: the share of samples
    spent under the package's code (inclusive), the self time by part (the
    part of the leaf frame), the package's functions by inclusive share, and
    the hottest leaves."""
    kinds = ("main", "pool")
    totals: Counter[str] = Counter()
    under_package: Counter[str] = Counter()
    self_time: dict[str, Counter[str]] = {kind: Counter() for kind in kinds}
    package: dict[str, Counter[str]] = {kind: Counter() for kind in kinds}
    leaves: dict[str, Counter[str]] = {kind: Counter() for kind in kinds}
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        processes = [frame for frame in frames if frame.startswith("process ")]
        frames = [frame for frame in frames if not frame.startswith("process ")]
        if not frames:
            continue
        kind = "pool" if len(processes) > 1 else "main"
        count = int(count_text)
        totals[kind] += count
        ours = {frame.split(" (")[0] + " (" + frame.split(" (")[1].split(":")[0] + ")"
                for frame in frames if "(celery_tooleffect/" in frame}
        if ours:
            under_package[kind] += count
        for function in ours:
            package[kind][function] += count
        self_time[kind][part_of(frames[-1])] += count
        leaves[kind][frames[-1]] += count
    out = []
    for kind in kinds:
        total = totals[kind]
        if not total:
            continue
        out.append(f"{kind} process{'es' if kind == 'pool' else ''}: {total} samples, "
                   f"{100 * under_package[kind] / total:.1f} % under celery_tooleffect")
        out.append("  self time by part:")
        for part, count in self_time[kind].most_common():
            out.append(f"    {100 * count / total:5.1f} %  {part}")
        out.append("  celery_tooleffect functions (inclusive):")
        for function, count in package[kind].most_common(top):
            out.append(f"    {100 * count / total:5.1f} %  {function}")
        out.append("  hottest leaves:")
        for leaf, count in leaves[kind].most_common(top):
            out.append(f"    {100 * count / total:5.1f} %  {leaf}")
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
        fetch = FETCH[args.variant]
        environment = worker_environment(prefix, server.url, fetch=fetch)
        with workers(1, 2, environment, logdir, IDLE_QUEUE, name=fetch) as started:
            wait_ready(app, started)
            check_fetch(started, fetch)
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
    print(f"py-spy of one worker under {args.variant} load for {args.seconds:g} s "
          f"(raw: {raw})\n")
    print(summarize(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
