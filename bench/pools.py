"""I/O-bound tools on Celery's threads pool, beside plain Celery: a one-off measure.

```sh
.venv/bin/python -m bench.pools            # 400 calls a round, bodies that wait 0.1 s
.venv/bin/python -m bench.pools --calls 100 --rounds 1
```

One redis-server of its own (AOF, broker, results and store in one database)
and two ``celery -A bench.app worker --pool threads`` processes, each of
concurrency 20 and ``worker_prefetch_multiplier`` 1 (what the start-up check
recommends there): one with kombu's fetch for plain Celery (the baseline,
``bench.plain``), one with the atomic fetch for the tools. Each round
publishes the calls of one variant to a queue of its own, lets the worker of
its fetch consume it, and rates it as ``bench.calls`` does, from the workers'
own ``date_done`` of the first and last call; the variants are interleaved.
Prints calls/s and the ratio to plain Celery of each variant (the median of
its rounds).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from pathlib import Path

from celery_tooleffect.testing import redis_server, start_celery_worker

from .app import ATOMIC, KOMBU
from .calls import CountingClient, _done_at, consume, producer_app, publish
from .servers import ROOT, wait_ready, worker_environment

VARIANTS = {
    "plain Celery": ("bench.plain", KOMBU),
    "READ_ONLY": ("bench.read_only", ATOMIC),
    "NON_IDEMPOTENT_WRITE": ("bench.non_idempotent_write", ATOMIC),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--body-seconds", type=float, default=0.1)
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the variants to run (the ratio needs plain Celery)")
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants}
    prefix = f"bp{uuid.uuid4().hex[:6]}:"
    with redis_server(appendonly=True) as server, \
            tempfile.TemporaryDirectory() as logs:
        app = producer_app(prefix, server.url, with_results=False)
        poller = CountingClient(server.client(socket_timeout=60))
        started = {}
        try:
            for fetch in sorted({fetch for _, fetch in variants.values()}):
                env = worker_environment(prefix, server.url, prefetch=args.prefetch,
                                         body_seconds=args.body_seconds, fetch=fetch)
                started[fetch] = start_celery_worker(
                    "bench.app", Path(logs) / f"{fetch}.log", pool=args.pool,
                    concurrency=args.concurrency, name=f"pools-{fetch}", wait=False,
                    env=env, queues=f"bench-idle-{fetch}", loglevel="WARNING", root=ROOT)
            wait_ready(app, list(started.values()))
            rates: dict[str, list[float]] = {variant: [] for variant in variants}
            for number in range(-1, args.rounds):
                for variant, (task_name, fetch) in variants.items():
                    size = args.concurrency * 2 if number < 0 else args.calls
                    queue = f"bench-pools-{uuid.uuid4().hex[:8]}"
                    ids = publish(app, task_name, queue, size)
                    results = consume(app, [started[fetch].name], queue, ids, prefix, poller,
                                      timeout=60 + size * args.body_seconds)
                    done = sorted(_done_at(result) for result in results)
                    if number >= 0:
                        rates[variant].append((size - 1) / max(done[-1] - done[0], 1e-6))
                        print(f"round {number + 1} {variant}: {rates[variant][-1]:.1f} calls/s",
                              flush=True)
        finally:
            for worker in started.values():
                worker.stop(timeout=30)
    baseline = statistics.median(rates.get("plain Celery") or [float("nan")])
    print(f"\n{args.pool}, concurrency {args.concurrency}, prefetch {args.prefetch}, "
          f"bodies {args.body_seconds:g} s, {args.calls} calls, median of {args.rounds} rounds")
    print("| variant | calls/s | ratio to plain Celery |\n|---|---|---|")
    for variant, values in rates.items():
        median = statistics.median(values)
        print(f"| {variant} | {median:.1f} | {median / baseline:.2f} |")


if __name__ == "__main__":
    main()
