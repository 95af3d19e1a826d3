"""A small TCP proxy for the fault tests: loopback only, bounded, stops itself.

It sits between the package's Redis clients and a Redis server and, on
command:

- drops every connection at once (``cut``);
- delays every chunk it forwards, both ways (``latency``). A chunk already read
  from one side is still forwarded after its delay even if the other side has
  given up, so a command a client timed out on can still reach the server: the
  server applies it and nobody hears the answer;
- cuts the connection that carries a given command (``cut_on``): either after
  the server answered it, dropping the answer (the command was applied, the
  client cannot know), or before forwarding it (it never ran).

It listens on 127.0.0.1 (or on an address of a network namespace the test
made itself: ``listen_host``), accepts a bounded number of connections, and
stops by itself after ``lifetime`` seconds if the test does not close it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType


@dataclass
class Trigger:
    """Cut the connection carrying a command whose bytes hold every one of ``parts``."""

    parts: tuple[bytes, ...]
    #: True: forward the command and drop the server's answer; False: drop the command.
    applied: bool
    remaining: int
    hits: int = 0

    def matches(self, chunk: bytes) -> bool:
        return self.remaining > 0 and all(part in chunk for part in self.parts)


@dataclass(eq=False)
class _Pair:
    client: socket.socket
    upstream: socket.socket
    #: The next answer from the server is dropped and the connection cut.
    drop_answer: bool = False
    closed: bool = field(default=False)


class StoreProxy:
    """Forward ``<listen_host>:<port>`` to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int, *, max_connections: int = 128,
                 lifetime: float = 300.0, listen_host: str = "127.0.0.1") -> None:
        self.upstream_port = upstream_port
        self.host = listen_host
        self.max_connections = max_connections
        self.lifetime = lifetime
        #: Seconds each forwarded chunk waits before it is sent on.
        self.latency = 0.0
        self.cuts = 0
        self.dropped = 0
        self.accepted = 0
        self._triggers: list[Trigger] = []
        self._lock = threading.Lock()
        self._pairs: set[_Pair] = set()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="store-proxy", daemon=True)

    def url(self, credentials: str = "") -> str:
        auth = f"{credentials}@" if credentials else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

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
            _close(pair)
        return len(pairs)

    def cut_on(self, *parts: bytes, applied: bool, times: int) -> Trigger:
        """Cut the connections of the next ``times`` commands holding all ``parts``."""
        trigger = Trigger(tuple(parts), applied, times)
        with self._lock:
            self._triggers.append(trigger)
        return trigger

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
                _close_sockets(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
            except OSError:
                _close_sockets(client)
                continue
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs.add(pair)
                self.accepted += 1
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            for to_server in (True, False):
                thread = threading.Thread(target=self._pump, args=(pair, to_server),
                                          name="store-proxy-pump", daemon=True)
                self._threads.append(thread)
                thread.start()
        # The lifetime is over (or close() was called): stop everything.
        self._stop.set()
        self.cut()

    def _trigger_for(self, chunk: bytes) -> Trigger | None:
        with self._lock:
            for trigger in self._triggers:
                if trigger.matches(chunk):
                    trigger.remaining -= 1
                    trigger.hits += 1
                    return trigger
        return None

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)
            self.dropped += 1
        _close(pair)

    def _pump(self, pair: _Pair, to_server: bool) -> None:
        source, target = (
            (pair.client, pair.upstream) if to_server else (pair.upstream, pair.client)
        )
        try:
            # The pair may have been cut (closed) before this thread started.
            source.settimeout(0.1)
        except OSError:
            return
        try:
            while not self._stop.is_set() and not pair.closed:
                try:
                    chunk = source.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                if to_server:
                    trigger = self._trigger_for(chunk)
                    if trigger is not None and not trigger.applied:
                        self._drop(pair)  # the command never reaches the server
                        return
                    if trigger is not None:
                        pair.drop_answer = True
                elif pair.drop_answer:
                    self._drop(pair)  # the server applied it; its answer is lost
                    return
                delay = self.latency
                if delay > 0 and self._stop.wait(delay):
                    break
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                self._pairs.discard(pair)
            _close(pair)


def _close(pair: _Pair) -> None:
    pair.closed = True
    _close_sockets(pair.client, pair.upstream)


def _close_sockets(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
