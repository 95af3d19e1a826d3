"""What the agent tests share: real ``celery worker``s of
``tests.apps.agent_tools_app`` and the package's MCP server as a subprocess
(``celery -A tests.apps.agent_tools_app tooleffect mcp``), over stdio or
streamable HTTP, driven by the ``mcp`` SDK's own ``ClientSession``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
import redis
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from celery_tooleffect.testing import WorkerProcess, start_celery_worker, wait_for
from tests.conftest import REDIS_URL, TESTS

APP = "tests.apps.agent_tools_app"
ROOT = TESTS.parent


class Agents:
    """One test's workers, MCP servers and counters, under its key prefix."""

    def __init__(self, prefix: str, tmp_path: Path) -> None:
        self.prefix = prefix
        self.tmp_path = tmp_path
        self.redis = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        self.env = {"TE_PREFIX": prefix, "TE_BROKER": REDIS_URL,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")]))}
        self.workers: list[WorkerProcess] = []
        self.servers: list[subprocess.Popen[bytes]] = []

    def worker(self, concurrency: int = 2) -> WorkerProcess:
        worker = start_celery_worker(
            APP, self.tmp_path / f"worker-{len(self.workers)}.log", concurrency=concurrency,
            name=f"agents{len(self.workers)}", root=ROOT, env=self.env)
        self.workers.append(worker)
        return worker

    def runs(self, key: str) -> int:
        """How many times a write's body ran for ``key``."""
        return int(self.redis.get(f"{self.prefix}count:{key}") or 0)

    def hold(self, key: str) -> None:
        self.redis.set(f"{self.prefix}hold:{key}", 1)

    def release(self, key: str) -> None:
        self.redis.delete(f"{self.prefix}hold:{key}")

    def command(self, *arguments: str) -> list[str]:
        return [sys.executable, "-m", "celery", "-A", APP, "tooleffect", *arguments]

    @asynccontextmanager
    async def stdio(self, *arguments: str, **session: Any) -> AsyncIterator[ClientSession]:
        """A client session with ``tooleffect mcp`` over stdio (a subprocess);
        ``session``: options of the ``ClientSession`` (``logging_callback``)."""
        command = self.command("mcp", *arguments)
        params = StdioServerParameters(command=command[0], args=command[1:],
                                       env={**os.environ, **self.env}, cwd=str(ROOT))
        with (self.tmp_path / "mcp-stderr.log").open("a") as errors:
            async with stdio_client(params, errlog=errors) as (read, write), \
                    ClientSession(read, write, **session) as client:
                await client.initialize()
                yield client

    def http_server(self, *arguments: str, token: str | None = "s3cret",
                    host: str = "127.0.0.1", port: int | None = None) -> str:
        """``tooleffect mcp --transport streamable-http`` on ``port`` (default a
        free one): its URL."""
        port = port or free_port()
        env = {**os.environ, **self.env}
        extra = list(arguments)
        if token is not None:
            env["TEST_MCP_TOKEN"] = token
            extra += ["--token-env", "TEST_MCP_TOKEN"]
        log = (self.tmp_path / f"mcp-http-{port}.log").open("wb")
        server = subprocess.Popen(
            self.command("mcp", "--transport", "streamable-http", "--host", host,
                         "--port", str(port), *extra),
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
            start_new_session=True)
        self.servers.append(server)
        wait_for(lambda: server.poll() is not None or answers(host, port), timeout=30,
                 what="the MCP server to listen")
        assert server.poll() is None, (self.tmp_path / f"mcp-http-{port}.log").read_text()
        return url_of(host, port)

    @asynccontextmanager
    async def http(self, url: str, token: str | None = "s3cret") -> AsyncIterator[ClientSession]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx2.AsyncClient(headers=headers,
                                      timeout=httpx2.Timeout(30, read=120)) as client, \
                streamable_http_client(url, http_client=client) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            yield session

    def close(self) -> None:
        for server in self.servers:
            if server.poll() is None:
                os.killpg(server.pid, 9)
                server.wait(10)
        for worker in self.workers:
            worker.kill()


def url_of(host: str, port: int) -> str:
    """The URL a client on this machine uses for a server listening on ``host``
    (a wildcard address through 127.0.0.1)."""
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/mcp"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def agents(prefix: str, tmp_path: Path) -> Iterator[Agents]:
    world = Agents(prefix, tmp_path)
    yield world
    world.close()


Poll = Callable[[], object]
