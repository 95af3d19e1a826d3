"""A TCP proxy that counts Redis round trips: loopback only, bounded, stops itself.

A round trip is one request answered: the proxy counts, per connection, each
time the server sends data after the client has sent some since the server's
last answer. A pipeline (many commands in one write, one read of all their
replies) is one round trip, which is what it costs; a message that Redis
pushes to a subscriber without being asked is none.

One proxy per role (broker, result backend, the package's store), all in
front of the same redis-server, tells which client pays which round trip.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from types import TracebackType


@dataclass(eq=False)
class _Connection:
    client: socket.socket
    upstream: socket.socket
    #: The client sent a request the server has not answered yet.
    awaiting_answer: bool = False


class CountingProxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``, counting round trips."""

    def __init__(self, upstream_port: int, *, lifetime: float = 1800.0,
                 max_connections: int = 256) -> None:
        self.upstream_port = upstream_port
        self.lifetime = lifetime
        self.max_connections = max_connections
        self._round_trips = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._accepted = 0
        self._thread = threading.Thread(target=self._serve, name="counting-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._round_trips

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    # -- the loop -------------------------------------------------------------

    def _serve(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        stop_at = time.monotonic() + self.lifetime
        try:
            while not self._stop.is_set() and time.monotonic() < stop_at:
                for key, _ in self._selector.select(timeout=0.1):
                    if key.data is None:
                        self._accept()
                    else:
                        connection, from_client = key.data
                        self._forward(connection, from_client)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._accepted >= self.max_connections:
            client.close()
            return
        self._accepted += 1
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        for sock in (client, upstream):
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(client, upstream)
        self._selector.register(client, selectors.EVENT_READ, (connection, True))
        self._selector.register(upstream, selectors.EVENT_READ, (connection, False))

    def _forward(self, connection: _Connection, from_client: bool) -> None:
        source = connection.client if from_client else connection.upstream
        target = connection.upstream if from_client else connection.client
        try:
            chunk = source.recv(1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(connection)
            return
        if from_client:
            connection.awaiting_answer = True
        elif connection.awaiting_answer:
            connection.awaiting_answer = False
            with self._lock:
                self._round_trips += 1
        try:
            target.sendall(chunk)
        except OSError:
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        for sock in (connection.client, connection.upstream):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
