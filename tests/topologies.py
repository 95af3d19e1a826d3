"""Redis set-ups as teams run them in production, made of real processes on
free loopback ports: a primary with replicas watched by three Sentinels, a
TLS server with its own certificates.

Each process lives in a folder of its own and is killed (and the folder
removed) when its context ends.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from celery_tooleffect.testing import RedisServer, free_port, redis_server_binary, wait_for

MASTER = "te-master"


@dataclass
class SentinelProcess:
    """One ``redis-server --sentinel`` watching ``master`` (quorum 2)."""

    master_port: int
    password: str = ""
    master_password: str = ""
    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="te-sentinel-")))
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelProcess:
        lines = [
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.workdir}",
            f"logfile {self.workdir / 'sentinel.log'}",
            f"sentinel monitor {MASTER} 127.0.0.1 {self.master_port} 2",
            f"sentinel down-after-milliseconds {MASTER} 1000",
            # Long enough that a loaded machine does not abort a failover
            # half done (its promoted replica would serve clients as a master
            # until the next epoch's failover demotes it, and lose what they
            # wrote); a failover that works takes ~2.5 s whatever this is.
            f"sentinel failover-timeout {MASTER} 30000",
            f"sentinel parallel-syncs {MASTER} 1",
        ]
        if self.master_password:
            lines.append(f"sentinel auth-pass {MASTER} {self.master_password}")
        if self.password:
            lines.append(f"requirepass {self.password}")
        config = self.workdir / "sentinel.conf"
        config.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen(
            [redis_server_binary(), str(config), "--sentinel"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self._pings(), timeout=15, what=f"sentinel on {self.port}")
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password or None, socket_timeout=2)

    def _pings(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def master_port_now(self) -> int | None:
        """The port of the master this Sentinel names now."""
        try:
            address = self.client().execute_command(
                "SENTINEL", "get-master-addr-by-name", MASTER)
        except redis.RedisError:
            return None
        return int(address[1]) if address else None

    def remove(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class SentinelSet:
    """A primary, its replicas and three Sentinels."""

    servers: list[RedisServer]
    sentinels: list[SentinelProcess]
    password: str = ""

    @property
    def urls(self) -> str:
        """The broker URL: every Sentinel, ``;``-separated (kombu's form)."""
        credentials = f":{self.password}@" if self.password else ""
        return ";".join(f"sentinel://{credentials}127.0.0.1:{s.port}/0"
                        for s in self.sentinels)

    def master(self) -> RedisServer:
        """The server the Sentinels name master now (a majority of them)."""
        ports = [s.master_port_now() for s in self.sentinels]
        port = max(set(ports), key=ports.count)
        return next(server for server in self.servers if server.port == port)

    def replicas(self) -> list[RedisServer]:
        master = self.master()
        return [server for server in self.servers if server is not master]

    def client(self, server: RedisServer) -> redis.Redis:
        return server.client()

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Until every live replica of the master is connected and in sync."""
        master = self.client(self.master())
        alive = [server for server in self.replicas()
                 if server.process is not None and server.process.poll() is None]

        def synced() -> bool:
            master.set("te:sync", time.time())
            return int(master.execute_command("WAIT", len(alive), 200)) >= len(alive)

        wait_for(synced, timeout=timeout, what="the replicas to be in sync")

    def fail_over(self, timeout: float = 30.0) -> RedisServer:
        """SIGKILL the master; return the replica the Sentinels promote, once
        every Sentinel names it (a Sentinel still naming the old master would
        send clients to it as soon as it is started again)."""
        old = self.master()
        old.kill()
        wait_for(lambda: len({s.master_port_now() for s in self.sentinels} - {old.port}) == 1
                 and all(s.master_port_now() != old.port for s in self.sentinels),
                 timeout=timeout, what="every Sentinel to name the promoted replica")
        new = self.master()
        wait_for(lambda: self.client(new).info("replication")["role"] == "master",
                 timeout=timeout, what="the promoted replica to act as master")
        return new

    def restart(self, server: RedisServer) -> None:
        """Start a killed server again: the Sentinels make it a replica."""
        server.start()


@contextlib.contextmanager
def sentinel_set(replicas: int = 1, password: str = "",
                 sentinel_password: str = "") -> Iterator[SentinelSet]:
    """A primary with ``replicas`` replicas (each with ``password`` as its
    ``requirepass`` and ``masterauth``) and three Sentinels (each with
    ``sentinel_password`` as its own ``requirepass``)."""
    servers: list[RedisServer] = []
    sentinels: list[SentinelProcess] = []
    try:
        primary = RedisServer(appendonly=True, password=password)
        servers.append(primary.start())
        for _ in range(replicas):
            replica = RedisServer(("--replicaof", "127.0.0.1", str(primary.port)),
                                  appendonly=True, password=password)
            servers.append(replica.start())
        for _ in range(3):
            sentinels.append(SentinelProcess(primary.port, sentinel_password, password).start())
        group = SentinelSet(servers, sentinels, password)
        wait_for(lambda: all(s.master_port_now() == primary.port for s in sentinels),
                 timeout=15, what="the Sentinels to know the master")
        if replicas:
            group.wait_replicated(timeout=20)
            # Each Sentinel must know the replicas before it can promote one.
            wait_for(lambda: all(len(s.client().execute_command(
                "SENTINEL", "replicas", MASTER)) >= replicas for s in sentinels),
                timeout=20, what="the Sentinels to know the replicas")
        yield group
    finally:
        for sentinel in sentinels:
            sentinel.remove()
        for server in servers:
            server.remove()


@dataclass(frozen=True)
class Certificates:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""

    folder: Path

    @property
    def ca(self) -> str:
        return str(self.folder / "ca.crt")

    def pair(self, name: str) -> tuple[str, str]:
        return str(self.folder / f"{name}.crt"), str(self.folder / f"{name}.key")


@contextlib.contextmanager
def certificates() -> Iterator[Certificates]:
    """Made with the openssl command line, valid for a day."""
    folder = Path(tempfile.mkdtemp(prefix="te-tls-"))

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    try:
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
                "-out", "ca.crt", "-subj", "/CN=tooleffect-test-ca", "-days", "1")
        (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for name in ("server", "client"):
            openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                    "-out", f"{name}.csr", "-subj", f"/CN={name}")
            openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                    "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
                    "-extfile", "san.ext")
        yield Certificates(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
