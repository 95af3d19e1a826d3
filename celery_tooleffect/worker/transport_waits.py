"""Between fetches: waiting for a list to fill without polling, and Redis's refusals.

A script cannot block, so when every list the atomic fetch
(:class:`celery_tooleffect.worker.transport.AtomicFetch`) tries is empty the
channel waits for one of them to fill with ``BLMOVE key key RIGHT RIGHT
timeout``: it blocks like ``BRPOP`` and wakes when a message arrives, but moves
the list's last element onto the list's own end, which leaves the list exactly
as it was. One such wait per list, each on a connection of its own (a blocking
command holds its connection), multiplexed in the worker's event loop beside
kombu's (:class:`Poller`); when one wakes, the fetch runs again. While messages
are waiting, no wait is sent: each fetch is one round trip.

A refused or failed fetch is logged and tried again :data:`REFUSED_RETRY`
seconds later, and so is a refused wait (``BLMOVE`` is a write: refused when
Redis is full, busy with a script or a replica); ``drain_events()`` polls no
longer than that then. A wait whose reply is overdue (a half-open socket) is
disconnected, as kombu does for a silent ``BRPOP``.

:class:`ListWaits` is mixed into the atomic fetch's channel; the transports
(:mod:`celery_tooleffect.worker.transport`) run their channels in :class:`Poller`.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from queue import Empty
from time import monotonic
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.eventio import ERR, READ

# The transport's logger: what the atomic fetch logs keeps one name, whichever
# of its modules logs it (log configurations name it).
logger = logging.getLogger("celery_tooleffect.worker.transport")

# kombu's helper is untyped; called through this.
_socket_readable: Any = kombu_redis._socket_readable

#: Seconds before a fetch that Redis refused (OOM, BUSY, READONLY ...) is tried again.
REFUSED_RETRY = 1.0


class _Wait:
    """One blocking wait for a list to fill, on a connection of its own."""

    __slots__ = ("client", "key", "sent_at", "timeout", "type")

    def __init__(self, key: str, client: Any) -> None:
        self.key = key
        #: The poller's name for this wait's socket (a handler of the channel).
        self.type = f"WAIT {key}"
        self.client = client
        self.sent_at: float | None = None
        self.timeout = 0.0

    def send(self, timeout: float) -> None:
        # BLMOVE onto the same end of the same list: blocks until the list has
        # an element, then leaves it where it was (Redis >= 6.2).
        self.client.connection.send_command("BLMOVE", self.key, self.key, "RIGHT", "RIGHT",
                                            timeout)
        self.sent_at = monotonic()
        self.timeout = timeout


class ListWaits:
    """Whether a channel of the atomic fetch fetches or waits, and its waits
    (mixed into :class:`~celery_tooleffect.worker.transport.AtomicFetch`)."""

    # kombu's Channel attributes this mixin uses (typed here for mypy).
    global_keyprefix: str
    health_check_interval: float
    handlers: dict[str, Any]
    connection: Any
    connection_errors: tuple[type[BaseException], ...]
    ResponseError: type[Exception]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Whether the next poll fetches (else: it waits for a list to fill).
        self._fetch_due = True
        self._waits: dict[str, _Wait] = {}
        self._refused_until = 0.0
        super().__init__(*args, **kwargs)

    def _refuse(self, what: str, refused: Exception) -> None:
        """Redis refused the fetch or a wait: fetch again in :data:`REFUSED_RETRY`
        seconds, not at once (Redis answers a refusal at once: trying again on
        the next poll would spin)."""
        now = monotonic()
        # The waits of every list are refused together: one warning for them.
        logger.log(logging.WARNING if now >= self._refused_until else logging.DEBUG,
                   "celery-tooleffect: Redis refused the %s (%s); fetching again in %.0f s",
                   what, refused, REFUSED_RETRY)
        self._refused_until = now + REFUSED_RETRY
        self._fetch_due = True

    # -- waiting for a list to fill -------------------------------------------

    def _arm_waits(self, names: list[str], timeout: float) -> None:
        wanted = {self.global_keyprefix + name for name in names}
        for key in wanted:
            wait = self._waits.get(key) or self._new_wait(key)
            if wait.sent_at is None:
                cycle = self.connection.cycle
                if not cycle._client_registered(self, wait.client, wait.type):
                    # New, or reconnecting after its connection was lost.
                    cycle._register(self, wait.client, wait.type)
                wait.send(timeout)
        for key, wait in list(self._waits.items()):
            if key not in wanted and wait.sent_at is None:
                self._drop_wait(wait)  # its queue is no longer consumed

    def _new_wait(self, key: str) -> _Wait:
        pool = self.async_pool  # type: ignore[attr-defined]
        # Each wait holds a connection of the channel's pool for as long as it
        # lives: the pool may hold that many more than kombu asked for.
        pool.max_connections += 1
        client = self._create_client(asynchronous=True)  # type: ignore[attr-defined]
        client.connection = pool.get_connection()
        wait = _Wait(key, client)
        self._waits[key] = wait
        self.handlers[wait.type] = partial(self._wait_read, wait)
        return wait

    def _wait_read(self, wait: _Wait) -> bool:
        """Read a wait's reply; whether its list filled (the next poll fetches:
        a wake-up delivers nothing by itself)."""
        connection = wait.client.connection
        wait.sent_at = None
        try:
            woken = wait.client.parse_response(connection, "BLMOVE")
        except self.connection_errors:
            connection.disconnect()
            raise
        except self.ResponseError as refused:
            # BLMOVE is a write (flagged denyoom): a full noeviction Redis refuses
            # it (OOM), as a Redis running a long script does (BUSY) and a
            # replica (READONLY). Raised, it would stop Celery's consumer (a
            # ResponseError is no connection error); sent again at once, it
            # would spin on the refusal.
            self._refuse("wait", refused)
            return False
        if woken is not None:
            self._fetch_due = True
        return woken is not None

    def _drop_wait(self, wait: _Wait) -> None:
        """Close a wait's connection, give it back to the pool, forget the wait."""
        connection, wait.client.connection = wait.client.connection, None
        if connection is not None:
            connection.disconnect()
            wait.client.connection_pool.release(connection)
        self._unregister_wait(wait)
        self._waits.pop(wait.key, None)
        self.handlers.pop(wait.type, None)
        wait.client.connection_pool.max_connections -= 1

    def _unregister_wait(self, wait: _Wait) -> None:
        """Take a wait's socket out of the poller (it is re-registered when the
        wait is sent again on a new connection)."""
        wait.sent_at = None
        cycle = self.connection.cycle if self.connection else None
        if cycle is None:
            return
        cycle._chan_to_sock.pop((self, wait.client, wait.type), None)
        for fd, (channel, type_) in list(cycle._fd_to_chan.items()):
            if channel is self and type_ == wait.type:
                del cycle._fd_to_chan[fd]
                # The event loop's own disconnect handler may have removed it.
                with contextlib.suppress(KeyError, ValueError, OSError):
                    cycle._unregister_from_poll(fd)

    def _check_waits(self, health_check_interval: float) -> None:
        """Disconnect a wait whose reply is overdue (a half-open socket), as
        kombu's ``maybe_check_brpop_health`` does for a silent BRPOP."""
        now = monotonic()
        for wait in list(self._waits.values()):
            if wait.sent_at is None:
                continue
            if now - wait.sent_at < wait.timeout + health_check_interval:
                continue
            connection = wait.client.connection
            sock = getattr(connection, "_sock", None)
            if sock is not None and _socket_readable(sock):
                continue
            logger.warning("celery-tooleffect: the wait on %s got no reply for %.0f s; "
                           "dropping its connection", wait.key, now - wait.sent_at)
            if connection is not None:
                connection.disconnect()

    def _on_connection_disconnect(self, connection: Any) -> None:
        # kombu first: it finds the registrations by the client's connection.
        super()._on_connection_disconnect(connection)  # type: ignore[misc]
        # A wait keeps its client and connection, which reconnects when the
        # wait is sent again (redis-py connects a disconnected connection).
        for wait in self._waits.values():
            if wait.client.connection is connection:
                self._unregister_wait(wait)

    def _close_clients(self) -> None:
        super()._close_clients()  # type: ignore[misc]
        for wait in list(self._waits.values()):
            self._drop_wait(wait)


class Poller(kombu_redis.MultiChannelPoller):
    """kombu's poller, which also reads the waits' wake-ups (and in
    ``drain_events()`` fetches after one at once)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        #: A wait woke during this get() (drain_events).
        self._woken = False

    def get(self, callback: Any, timeout: float | None = None) -> Any:
        """kombu's get (``drain_events()``), with two differences:

        - a poll waits no longer than until a refused fetch may be tried again:
          with no command in flight nothing would wake it (kombu's BRPOP always
          has one), and ``drain_events()`` without a timeout would wait forever;
        - a wake-up is followed by the fetch within the same call: kombu's get
          raises Empty for a round without delivery, and ``drain_events()``
          sleeps ``polling_interval`` (when set) before it polls again.
        """
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            self._woken = False
            try:
                return super().get(callback, timeout=self._poll_timeout(deadline))  # type: ignore[no-untyped-call]
            except Empty:
                if not self._woken or (deadline is not None and monotonic() >= deadline):
                    raise

    def _poll_timeout(self, deadline: float | None) -> float | None:
        now = monotonic()
        timeout = None if deadline is None else max(deadline - now, 0.0)
        for channel in self._channels:
            refused_until = getattr(channel, "_refused_until", 0.0)
            if refused_until > now:
                left = refused_until - now
                timeout = left if timeout is None else min(timeout, left)
        return timeout

    def on_readable(self, fileno: int) -> Any:
        chan_type = self._fd_to_chan.get(fileno)
        if chan_type is not None and str(chan_type[1]).startswith("WAIT "):
            if fileno in self._paused_brpop:
                return None
            channel, type_ = chan_type
            # Read whether or not the channel may consume: a wake-up left
            # unread would keep the socket readable and spin the event loop.
            if channel.handlers[type_]():
                self._woken = True
            return None
        return super().on_readable(fileno)  # type: ignore[no-untyped-call]

    def handle_event(self, fileno: int, event: int) -> Any:
        chan_type = self._fd_to_chan.get(fileno)
        if chan_type is not None and str(chan_type[1]).startswith("WAIT "):
            # A wake-up is no delivery (get() goes on and fetches). An error
            # event is read too: the read raises the connection's error, which
            # disconnects it; an unread error event would be reported forever.
            if event & (READ | ERR):
                self.on_readable(fileno)
            return None
        return super().handle_event(fileno, event)  # type: ignore[no-untyped-call]

    def maybe_restore_messages(self) -> Any:
        # kombu's restore sweep runs after every get() that delivered nothing
        # and lets a refusal (OOM on its lock's SET, BUSY) out of
        # drain_events(), where the fetch's own refusals are retried: it is
        # retried at the next sweep instead, as kombu's
        # maybe_refresh_binding_expiry does with refused scripts.
        try:
            return super().maybe_restore_messages()  # type: ignore[no-untyped-call]
        except redis.ResponseError as refused:
            logger.warning("celery-tooleffect: Redis refused kombu's restore of unacknowledged "
                           "messages (%s); it runs again at the next sweep", refused)
            return None

    def maybe_check_brpop_health(self) -> None:
        super().maybe_check_brpop_health()  # type: ignore[no-untyped-call]
        for channel in self._channels:
            if isinstance(channel, ListWaits) and channel.health_check_interval:
                channel._check_waits(channel.health_check_interval)

