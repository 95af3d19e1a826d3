"""The real parts a benchmark run starts: a private redis-server and ``celery worker``s.

Everything runs on this machine, on loopback, and is stopped when the run
ends. The redis-server is the run's own, so its command statistics count only
the benchmark's traffic, and nothing of anyone else's is flushed or slowed.
Waiting uses the test suite's bounded poll (``tests.conftest.wait_for``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from celery_tooleffect.demo import redis_server as demo_redis_server
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RedisServer:
    """A redis-server of the run's own, on a free loopback port."""

    url: str
    appendonly: bool

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=60)


@contextlib.contextmanager
def redis_server(*, appendonly: bool) -> Iterator[RedisServer]:
    """Start a redis-server (the demo's), with or without AOF."""
    with demo_redis_server(appendonly=appendonly) as url:
        yield RedisServer(url, appendonly)


@dataclass
class Worker:
    """A ``celery -A bench.app worker`` process (prefork)."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds (user + system) spent so far by the main process and by its
        pool processes (those alive now)."""
        pid = self.process.pid
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            children = []
        return _cpu_seconds(pid), sum(_cpu_seconds(int(child)) for child in children)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def redis_cpu_seconds(client: redis.Redis) -> float:
    """CPU seconds the redis-server has spent (user + system)."""
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def worker_environment(prefix: str, broker: str, *, backend: str | None = None,
                       store: str | None = None, prefetch: int = 4,
                       body_seconds: float = 0.0) -> dict[str, str]:
    """What ``bench.app`` reads: the run's prefix, Redis URLs and body time."""
    return dict(
        os.environ, BENCH_PREFIX=prefix, BENCH_BROKER=broker, BENCH_BACKEND=backend or "",
        BENCH_STORE=store or "", BENCH_PREFETCH=str(prefetch),
        BENCH_BODY_SECONDS=repr(body_seconds), PYTHONPATH=str(ROOT),
    )


@contextlib.contextmanager
def workers(count: int, concurrency: int, environment: dict[str, str], logdir: Path,
            queues: str) -> Iterator[list[Worker]]:
    """Start ``count`` prefork workers listening to ``queues``; wait until they are ready."""
    started: list[Worker] = []
    try:
        for index in range(count):
            name = f"bench{index}-{uuid.uuid4().hex[:6]}@{os.uname().nodename}"
            log = logdir / f"{name.split('@')[0]}.log"
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bench.app", "worker", "--pool",
                 "prefork", "--concurrency", str(concurrency), "--loglevel", "WARNING",
                 "--without-gossip", "--without-mingle", "--without-heartbeat",
                 "-Q", queues, "-n", name],
                stdout=log.open("wb"), stderr=subprocess.STDOUT, env=environment,
                cwd=str(ROOT), start_new_session=True,
            )
            started.append(Worker(name, process, log))
        yield started
    finally:
        for worker in started:
            worker.stop()


def wait_ready(app: Any, started: list[Worker], timeout: float = 60.0) -> None:
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
