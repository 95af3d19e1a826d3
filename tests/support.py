"""The test suite's own helpers: its Celery settings and a fault-injecting TCP proxy.

Not shipped with the package (``celery_tooleffect.testing`` keeps what the
pytest plugin, the demo and users' tests need). The crash test
(``chaos/``) and the benchmarks (``bench/``) use these too: they run from the
repository.

- :data:`REDIS_URL`, :data:`TEST_FETCH`, :func:`app_config`: which Redis and
  fetch the suite uses, and the settings of its apps;
- :class:`TcpProxy`: a loopback TCP proxy (cuts, delays, targeted cuts, round
  trip counting);
- :class:`Monitor`: every command a Redis server receives while it is open.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import redis

#: The Redis the test suite and the crash test use (broker, results, store).
REDIS_URL = os.environ.get("TOOLEFFECT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The fetch the test suite's apps use on a Redis broker: ``atomic`` (the
#: package's, the default) or ``kombu`` (``tooleffect_atomic_fetch=False``).
#: CI runs the core scenarios with each.
TEST_FETCH = os.environ.get("TOOLEFFECT_TEST_FETCH", "atomic")


# -- what a Redis server receives -------------------------------------------------------


@dataclass
class Monitor:
    """Redis ``MONITOR`` of a server, in a thread, while open: every command but
    the monitor's own, in order (the tests that count round trips and the
    commands a worker needs)."""

    #: A client of the server (``RedisServer.client()``).
    client: redis.Redis
    #: What ``MONITOR`` reported, one dict a command (redis-py's ``next_command``).
    received: list[dict[str, Any]] = field(default_factory=list)
    #: Addresses (``ip:port``) whose commands :meth:`sent` leaves out.
    ignored: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._monitor: Any = self.client.monitor()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._stop = f"tooleffect-monitor-stop-{uuid.uuid4().hex}"

    def __enter__(self) -> Monitor:
        # redis-py's Monitor.__enter__ sends MONITOR and reads its OK: from
        # here on every command is seen.
        self._monitor.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.client.echo(self._stop)
        self._thread.join(20)
        self._monitor.__exit__(*exc_info)

    def _watch(self) -> None:
        while True:
            command = self._monitor.next_command()
            if self._stop in command["command"]:
                return
            self.received.append(command)

    def sent(self) -> list[list[str]]:
        """The commands clients sent (not those a script ran), each as its words."""
        return [command["command"].split(" ") for command in list(self.received)
                if command.get("client_type") != "lua"
                and f"{command['client_address']}:{command['client_port']}" not in self.ignored]

    def named(self, name: str) -> list[list[str]]:
        """The commands clients sent of one name (``BLMOVE``)."""
        return [words for words in self.sent() if words[0].upper() == name.upper()]

    def acl_names(self) -> set[str]:
        """Every command the server ran, scripts' too, as an ACL names it
        (``get``, ``script|load``): what the user the commands ran as needs."""
        names = set()
        for command in list(self.received):
            words = command["command"].split(" ")
            name = words[0].lower()
            if name in ("script", "client", "config", "acl") and len(words) > 1:
                name = f"{name}|{words[1].lower()}"
            names.add(name)
        return names


# -- Celery settings -------------------------------------------------------------------


#: The addresses a block of the docs may name for its store and broker, which
#: tests/test_docs_code.py replaces with its own redis-server's.
DOCS_ADDRESSES = ("redis://localhost:6379/0", "redis://127.0.0.1:6379/0")


def app_config(prefix: str, **overrides: Any) -> dict[str, Any]:
    """The test suite's Celery settings: every key under ``prefix`` on
    :data:`REDIS_URL`, queue ``tools``, short retry backoff (``overrides`` win)."""
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
        "tooleffect_atomic_fetch": TEST_FETCH != "kombu",
        # The suite's Redis keeps nothing on disk (a test server, started by
        # the machine or by .ci/run); tests/faults/test_durability.py checks
        # the refusal this turns into a warning.
        "tooleffect_allow_volatile_store": True,
    }
    conf.update(overrides)
    return conf



# -- a TCP proxy ---------------------------------------------------------------------------


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
    #: The client sent a request the server has not answered yet.
    awaiting_answer: bool = False
    closed: bool = False


class TcpProxy:
    """Forward ``<listen_host>:<port>`` to ``<upstream_host>:<upstream_port>``.

    Loopback only (or an address of a network namespace the caller made:
    ``listen_host``), bounded (``max_connections``), and it stops by itself
    after ``lifetime`` seconds if nobody closes it. On command it:

    - drops every connection at once (:meth:`cut`);
    - delays every chunk it forwards, both ways (:attr:`latency`). A chunk
      already read from one side is still forwarded after its delay even if
      the other side has given up, so a command a client timed out on can still
      reach the server: the server applies it and nobody hears the answer;
    - cuts the connection that carries a given command (:meth:`cut_on`):
      either after the server answered it, dropping the answer (the command
      was applied, the client cannot know), or before forwarding it (it never
      ran).

    It also counts round trips (:attr:`round_trips`): a request answered, i.e.
    each time the server sends data after the client sent some since the
    server's last answer. A pipeline (many commands in one write, one read of
    all their replies) is one round trip; a message Redis pushes to a
    subscriber without being asked is none. One proxy per role (broker, result
    backend, store) in front of the same server tells which client pays which.

    :meth:`start` it, or use it as a context manager.
    """

    def __init__(self, upstream_port: int, *, max_connections: int = 128,
                 lifetime: float = 300.0, listen_host: str = "127.0.0.1",
                 upstream_host: str = "127.0.0.1") -> None:
        self.upstream_port = upstream_port
        self.upstream_host = upstream_host
        self.host = listen_host
        self.max_connections = max_connections
        self.lifetime = lifetime
        #: Seconds each forwarded chunk waits before it is sent on.
        self.latency = 0.0
        self.cuts = 0
        self.dropped = 0
        self.accepted = 0
        self._round_trips = 0
        self._triggers: list[Trigger] = []
        self._lock = threading.Lock()
        self._pairs: set[_Pair] = set()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, 0))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)

    def url(self, credentials: str = "") -> str:
        """The proxy as a Redis URL (``credentials``: ``user:password``)."""
        auth = f"{credentials}@" if credentials else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._round_trips

    # -- control ----------------------------------------------------------------

    def start(self) -> TcpProxy:
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

    def __enter__(self) -> TcpProxy:
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
                upstream = socket.create_connection(
                    (self.upstream_host, self.upstream_port), timeout=2)
            except OSError:
                _close_sockets(client)
                continue
            for sock in (client, upstream):
                # Blocking, bounded sends; reads wait on a selector (see _pump).
                sock.settimeout(30)
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs.add(pair)
                self.accepted += 1
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            for to_server in (True, False):
                thread = threading.Thread(target=self._pump, args=(pair, to_server),
                                          name="tcp-proxy-pump", daemon=True)
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

    def _answered(self, pair: _Pair) -> None:
        with self._lock:
            if pair.awaiting_answer:
                pair.awaiting_answer = False
                self._round_trips += 1

    def _pump(self, pair: _Pair, to_server: bool) -> None:
        source, target = (
            (pair.client, pair.upstream) if to_server else (pair.upstream, pair.client)
        )
        selector = selectors.DefaultSelector()
        try:
            # The pair may have been cut (closed) before this thread started.
            selector.register(source, selectors.EVENT_READ)
        except (OSError, ValueError):
            selector.close()
            return
        try:
            while not self._stop.is_set() and not pair.closed:
                if not selector.select(0.1):
                    continue
                chunk = source.recv(65536)
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
                else:
                    self._answered(pair)
                delay = self.latency
                if delay > 0 and self._stop.wait(delay):
                    break
                if to_server:
                    with self._lock:
                        pair.awaiting_answer = True
                target.sendall(chunk)
        except (OSError, ValueError):
            pass
        finally:
            selector.close()
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


# -- a run's audit events as Redis holds them (celery_tooleffect/store/chain.py) --


def run_list(client: redis.Redis, key: str) -> tuple[bytes, list[bytes]]:
    """A run's events list: its header and its elements, read with ``LRANGE``."""
    raw = [item if isinstance(item, bytes) else item.encode()
           for item in client.lrange(key, 0, -1)]
    return (raw[0], raw[1:]) if raw else (b"", [])


def split_items(element: bytes) -> list[tuple[bytes, bytes]]:
    """The stored (name, value) pairs of one element, parsed here independently
    of the package: two 8-hex sums, then ``<length>:<bytes>`` items."""
    body, items, at = element[16:], [], 0
    while at < len(body):
        colon = body.index(b":", at)
        length = int(body[at:colon])
        items.append(body[colon + 1:colon + 1 + length])
        at = colon + 1 + length
    return list(zip(items[::2], items[1::2], strict=True))


def join_items(sums: bytes, items: list[tuple[bytes, bytes]]) -> bytes:
    """An element from its two sums and stored pairs (to edit one by hand)."""
    return sums + b"".join(b"%d:%s" % (len(part), part) for pair in items for part in pair)


def stored_phases(client: redis.Redis, key: str) -> list[bytes]:
    """Each event's phase (``p``, or the ``+p`` its script put in its place)."""
    phases = []
    for element in run_list(client, key)[1]:
        items = dict(split_items(element))
        phases.append(items.get(b"+p", items.get(b"p", b"")))
    return phases


def run_fields(client: redis.Redis, key: str) -> list[dict[bytes, bytes]]:
    """Each event of a run's list as readers see it, decoded here: its stored
    names read back (one character: a code of ``chain.CODES``; ``=``: as
    written; ``+``: added by the script, in place of the one sent), and an
    outcome that names no task taking ``chain.INHERITED`` from the full event
    before it."""
    from celery_tooleffect.store.chain import CODES, INHERITED

    codes = {code.encode(): name.encode() for name, code in CODES.items()}

    def name_of(stored: bytes) -> bytes:
        if stored.startswith(b"="):
            return stored[1:]
        return codes.get(stored, stored) if len(stored) == 1 else stored

    events: list[dict[bytes, bytes]] = []
    full: dict[bytes, bytes] | None = None
    for element in run_list(client, key)[1]:
        sent: dict[bytes, bytes] = {}
        added: dict[bytes, bytes] = {}
        for stored, value in split_items(element):
            if stored.startswith(b"+"):
                added[name_of(stored[1:])] = value
            else:
                sent[name_of(stored)] = value
        if b"task_id" in sent:
            full = dict(sent)
        elif full is not None:
            sent = {**{name.encode(): full[name.encode()] for name in INHERITED
                       if name.encode() in full}, **sent}
        events.append({**sent, **added})
    return events
