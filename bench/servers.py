"""The real parts a benchmark run starts: a private redis-server and ``celery worker``s.

Everything runs on this machine, on loopback, and is stopped when the run
ends. The redis-server is the run's own, so its command statistics count only
the benchmark's traffic, and nothing of anyone else's is flushed or slowed.
The processes, the counting proxies and the bounded poll are those of
:mod:`celery_tooleffect.testing` (the demo and the test suite use them too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from celery_tooleffect.store.servers import online_replicas
from celery_tooleffect.testing import (
    RedisServer,
    WorkerProcess,
    redis_server,
    start_celery_worker,
    wait_for,
)

from .app import ATOMIC

ROOT = Path(__file__).resolve().parent.parent


def redis_cpu_seconds(client: redis.Redis) -> float:
    """CPU seconds the redis-server has spent (user + system)."""
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def worker_environment(prefix: str, broker: str, *, backend: str | None = None,
                       store: str | None = None, prefetch: int = 4,
                       body_seconds: float = 0.0, store_replicas: int = 0,
                       fetch: str = ATOMIC) -> dict[str, str]:
    """What ``bench.app`` reads: the run's prefix, Redis URLs, body time, the
    replicas each journal write waits for and the fetch from the broker."""
    return dict(
        os.environ, BENCH_PREFIX=prefix, BENCH_BROKER=broker, BENCH_BACKEND=backend or "",
        BENCH_STORE=store or "", BENCH_PREFETCH=str(prefetch),
        BENCH_BODY_SECONDS=repr(body_seconds), BENCH_STORE_REPLICAS=str(store_replicas),
        BENCH_FETCH=fetch, PYTHONPATH=str(ROOT),
    )


@contextlib.contextmanager
def workers(count: int, concurrency: int, environment: dict[str, str], logdir: Path,
            queues: str, name: str = "bench") -> Iterator[list[WorkerProcess]]:
    """Start ``count`` prefork ``celery -A bench.app worker``s listening to
    ``queues``, named ``<name><index>-...`` (:func:`wait_ready` waits until
    they answer); stopped at the end."""
    started: list[WorkerProcess] = []
    try:
        for index in range(count):
            log = logdir / f"{name}{index}-{os.urandom(3).hex()}.log"
            started.append(start_celery_worker(
                "bench.app", log, concurrency=concurrency, name=f"{name}{index}", wait=False,
                env=environment, queues=queues, loglevel="WARNING", root=ROOT,
            ))
        yield started
    finally:
        for worker in started:
            worker.stop(timeout=30)


def wait_ready(app: Any, started: list[WorkerProcess], timeout: float = 60.0) -> None:
    """Wait until every worker answers a ping; raise with its log if one died."""
    names = {worker.name for worker in started}

    def ready() -> bool:
        for worker in started:
            if worker.process.poll() is not None:
                raise RuntimeError(f"worker {worker.name} exited:\n{worker.output()[-4000:]}")
        replies = app.control.ping(destination=sorted(names), timeout=0.5) or []
        answered = {name for reply in replies for name in reply}
        return names <= answered

    wait_for(ready, timeout=timeout, interval=0.2, what="the workers to answer a ping")


#: What a worker's start-up banner adds to its transport line when it fetches
#: with the package's atomic fetch (``celery_tooleffect.worker.transport``).
ATOMIC_BANNER = "(atomic fetch)"


def check_fetch(started: list[WorkerProcess], fetch: str) -> None:
    """Raise unless every worker's start-up banner says it uses ``fetch`` (call
    after :func:`wait_ready`: the banner is printed before the worker answers)."""
    for worker in started:
        banner = next((line for line in worker.output().splitlines()
                       if "transport:" in line), None)
        if banner is None:
            raise RuntimeError(f"worker {worker.name} printed no transport line:\n"
                               f"{worker.output()[-4000:]}")
        if (ATOMIC_BANNER in banner) != (fetch == ATOMIC):
            raise RuntimeError(f"worker {worker.name} should use the {fetch} fetch, "
                               f"its banner says: {banner.strip()}")


@contextlib.contextmanager
def replicas_of(server: RedisServer, count: int) -> Iterator[list[RedisServer]]:
    """``count`` replicas of ``server`` (``--replicaof``, no persistence of
    their own), in sync before the run goes on; removed at the end."""
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(redis_server("--replicaof", "127.0.0.1",
                                                     str(server.port)))
                    for _ in range(count)]
        if count:
            wait_for(lambda: online_replicas(server.client()) >= count, timeout=30,
                     what="the replicas to be in sync")
        yield replicas
