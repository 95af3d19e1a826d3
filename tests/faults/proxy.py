"""A small TCP proxy for the fault tests: loopback only, bounded, stops itself.

It sits between the package's Redis clients and a Redis server. On command it
drops every connection at once (``cut``), and it can delay every chunk it
forwards, both ways (``latency``). A chunk already read from one side is still
forwarded after its delay even when the other side has gone, so a command that
a client gave up on can reach the server: that is how a reply lost after the
server applied a script (an ambiguous outcome) is produced.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


class StoreProxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int, *, max_connections: int = 128,
                 lifetime: float = 300.0) -> None:
        self.upstream_port = upstream_port
        self.max_connections = max_connections
        self.lifetime = lifetime
        #: Seconds each forwarded chunk waits before it is sent on.
        self.latency = 0.0
        self.cuts = 0
        self.dropped = 0
        self.accepted = 0
        self.delayed = 0
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="store-proxy", daemon=True)

    def url(self, credentials: str = "") -> str:
        auth = f"{credentials}@" if credentials else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    # -- control ----------------------------------------------------------------

    def start(self) -> StoreProxy:
        self._acceptor.start()
        return self

    def cut(self) -> int:
        """Drop every open connection now; how many were dropped."""
        with self._lock:
            pairs = list(self._pairs)
            self._pairs.clear()
            self.cuts += 1
            self.dropped += len(pairs)
        for pair in pairs:
            _close(*pair)
        return len(pairs)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        """Stop accepting, drop every connection, and wait for the threads."""
        self._stop.set()
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()
        for thread in [self._acceptor, *self._threads]:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(5)

    def __enter__(self) -> StoreProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- forwarding ---------------------------------------------------------------

    def _accept(self) -> None:
        ends = time.monotonic() + self.lifetime
        while not self._stop.is_set() and time.monotonic() < ends:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            with self._lock:
                full = len(self._pairs) >= self.max_connections
            if full:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
            except OSError:
                _close(client)
                continue
            pair = (client, upstream)
            with self._lock:
                self._pairs.add(pair)
                self.accepted += 1
            for source, target in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(pair, source, target),
                                          name="store-proxy-pump", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._threads = [thread for thread in self._threads if thread.is_alive()]
        # The lifetime is over (or close() was called): stop everything.
        self._stop.set()
        self.cut()

    def _pump(self, pair: tuple[socket.socket, socket.socket], source: socket.socket,
              target: socket.socket) -> None:
        source.settimeout(0.1)
        try:
            while not self._stop.is_set():
                try:
                    chunk = source.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                delay = self.latency
                if delay > 0:
                    self.delayed += 1
                    if self._stop.wait(delay):
                        break
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                self._pairs.discard(pair)
            _close(*pair)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
