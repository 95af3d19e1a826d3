"""kombu's Redis transport with an atomic fetch: no message is lost in the fetch.

kombu's Redis transport (``kombu/transport/redis.py``, 5.7) takes a message
off its queue with ``BRPOP`` and records it as unacknowledged only afterwards
(``QoS.append``: ``ZADD unacked_index`` and ``HSET unacked``, a second round
trip). A worker killed between the two loses the message without a trace
(kombu #305, celery #4354, celery #1392). Here one Lua script
(``scripts/fetch.lua``) does both, in kombu's own format, so that kombu's
restore, ``visibility_timeout``, ``unacked_mutex`` and acknowledgement, and
the package's leases, work on the record unchanged:

- **Order.** The script tries the lists in the order kombu's ``BRPOP`` names
  them (every priority step of every queue, the queues in the channel's
  ``queue_order_strategy`` cycle, rotated after each message as kombu rotates
  it), honouring ``global_keyprefix``, ``sep`` and ``priority_steps``.
- **Blocking without polling.** A script cannot block, so when every list is
  empty the channel waits for one of them to fill with ``BLMOVE key key RIGHT
  RIGHT timeout``: it blocks like ``BRPOP`` and wakes when a message arrives,
  but moves the list's last element onto the list's own end, which leaves the
  list exactly as it was. One such wait per list, each on a connection of its
  own (a blocking command holds its connection), multiplexed in the worker's
  event loop beside kombu's; when one wakes, the script runs again. While
  messages are waiting, no wait is sent: each fetch is one round trip.
- **What stays kombu's.** Publishing, fanout and pidbox (``celery inspect``,
  ``revoke`` broadcasts), restore, acknowledgement, reject and requeue.
  Messages of plain kombu producers are consumed as they are; a worker with
  this fetch and one without can share queues (both keep the same records).
- **Bad input.** An item that is no kombu envelope (not JSON, not an object,
  no ``properties``, no delivery tag, headers that are no object, a body
  kombu cannot decode) is recorded under a tag of its own as a kombu envelope
  of content type :data:`UNREADABLE` whose body is the item's bytes,
  untouched, and delivered: Celery's consumer cannot decode it and the
  package's consumer step stores it as a dead letter (``undecodable_message``).
  It never stops the consumer, and kombu's restore (which expects JSON in
  ``unacked``, and headers it can mark redelivered) never meets it. Such an
  item takes a second round trip, still atomic: ``fetch.lua`` leaves it
  queued and returns it, the worker reads it with Python's json (an envelope
  after all, as one with a lone surrogate, which cjson refuses, is taken as
  it is) or wraps it (base64 in Lua blocked Redis for seconds on a large
  item), and ``fetch_checked.lua`` records it so and pops it if it is still
  the list's next item. An item the first script took for an envelope (cjson
  reads more than Python's json) but that Python cannot read is recorded
  again so before it is delivered.
- **Failures.** The script records the message before it pops it (a write
  refused half-way, as under ``maxmemory``, leaves it queued); a refused or
  failed script is logged and tried again a second later, and so is a
  refused wait (``BLMOVE`` is a write: refused when Redis is full, busy with a
  script or a replica); ``drain_events()`` polls no longer than that second
  then. A cut connection after the script ran leaves the message in
  ``unacked``, where kombu's restore finds it after the visibility timeout.

:class:`Transport` and :class:`SentinelTransport` are what an app that uses the
package connects with (``celery_tooleffect.worker.fetch`` chooses them; the
setting ``tooleffect_atomic_fetch = False`` keeps kombu's own). Needs Redis
6.2 or newer (``BLMOVE``), as the package's leases do (``ZADD GT``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import logging
import uuid
from collections.abc import Iterator, Mapping
from functools import partial
from queue import Empty
from time import monotonic, time
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.eventio import ERR, READ
from kombu.utils.json import dumps, loads
from redis.exceptions import NoScriptError

from .lua import script

logger = logging.getLogger(__name__)

# kombu's helpers are untyped; called through these.
_bytes_to_str: Any = bytes_to_str
_dumps: Any = dumps
_loads: Any = loads
_socket_readable: Any = kombu_redis._socket_readable

#: The content type of the envelope an item that is no kombu envelope is
#: delivered (and recorded) in: its body is the item's bytes as they were
#: queued. Celery's consumer cannot decode it and hands it to on_decode_error,
#: where the package dead-letters it with those bytes as its body; kombu's
#: restore puts the envelope, valid JSON, back on the queue.
UNREADABLE = "application/x-tooleffect-unreadable"

#: Seconds before a fetch that Redis refused (OOM, BUSY, READONLY ...) is tried again.
REFUSED_RETRY = 1.0


def unreadable_envelope(item: bytes, tag: str, queue: str) -> dict[str, Any]:
    """The kombu envelope that carries a queue item that is no kombu envelope."""
    return {
        "body": base64.b64encode(item).decode("ascii"),
        "content-encoding": "binary",
        "content-type": UNREADABLE,
        "headers": {},
        "properties": {
            "body_encoding": "base64",
            "delivery_tag": tag,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
        },
    }


def _routing(envelope: Mapping[str, Any], queue: str) -> tuple[str, str]:
    """The exchange and routing key kombu's QoS.append records for an envelope;
    fields that are no text make it the queue it came from (as fetch.lua does)."""
    info = envelope["properties"]["delivery_info"]
    exchange, routing_key = info.get("exchange"), info.get("routing_key")
    if not isinstance(exchange, str) or not isinstance(routing_key, str):
        return "", queue
    return exchange, routing_key


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


class QoS(kombu_redis.QoS):
    """kombu's QoS, except that a message the fetch recorded is not recorded again."""

    channel: AtomicFetch

    def append(self, message: Any, delivery_tag: str) -> None:
        recorded = self.channel._recorded
        if delivery_tag in recorded:
            recorded.discard(delivery_tag)
            # Only kombu's in-memory bookkeeping: Redis has the record.
            virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        super().append(message, delivery_tag)  # type: ignore[no-untyped-call]


class AtomicFetch:
    """The fetch of a kombu Redis channel, made atomic (mixed into kombu's
    ``Channel`` and ``SentinelChannel``)."""

    QoS = QoS

    # kombu's Channel attributes this mixin uses (typed here for mypy).
    active_queues: list[str]
    priority_steps: list[int]
    global_keyprefix: str
    unacked_key: str
    unacked_index_key: str
    brpop_timeout: float
    health_check_interval: float
    handlers: dict[str, Any]
    connection: Any
    client: Any
    connection_errors: tuple[type[BaseException], ...]
    ResponseError: type[Exception]
    _queue_cycle: Any
    _in_poll: Any
    _brpop_sent_at: float | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Tags the fetch recorded in Redis that kombu's QoS has not taken yet.
        self._recorded: set[str] = set()
        #: Whether the next poll fetches (else: it waits for a list to fill).
        self._fetch_due = True
        #: (queue, list) of each list of the fetch in flight.
        self._fetching: list[tuple[str, str]] = []
        self._waits: dict[str, _Wait] = {}
        self._refused_until = 0.0
        prefix = uuid.uuid4().hex
        self._tags: Iterator[str] = (f"{prefix}.{n}" for n in itertools.count())
        super().__init__(*args, **kwargs)

    # -- the fetch ----------------------------------------------------------------

    def _lists(self) -> list[tuple[str, str]]:
        """(queue, list) in the order kombu's BRPOP would try them."""
        queues = self._queue_cycle.consume(len(self.active_queues))
        return [(queue, self._q_for_pri(queue, pri))  # type: ignore[attr-defined]
                for pri in self.priority_steps for queue in queues]

    def _fetch_command(self, lists: list[tuple[str, str]]) -> list[Any]:
        prefix = self.global_keyprefix
        keys = [prefix + self.unacked_key, prefix + self.unacked_index_key,
                *(prefix + name for _, name in lists)]
        # ARGV[1] the score, ARGV[2..] the queue of each list (lined up with
        # KEYS[3..]; see fetch.lua).
        args = [repr(time()), *(queue for queue, _ in lists)]
        return ["EVALSHA", script("fetch").sha, len(keys), *keys, *args]

    def _brpop_start(self, timeout: float | None = None) -> None:
        # kombu calls this on every poll of a channel that may consume and has
        # no command in flight (MultiChannelPoller._register_BRPOP).
        if timeout is None:
            timeout = self.brpop_timeout
        lists = self._lists()
        if not lists:
            return
        if not self._fetch_due:
            # Each wait times out after brpop_timeout times the number of
            # lists: an idle worker sends as many commands as kombu's single
            # BRPOP over them all would (one per brpop_timeout).
            self._arm_waits([name for _, name in lists], timeout * len(lists))
            return
        if monotonic() < self._refused_until:
            return
        self._fetching = lists
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = monotonic()
        connection.send_command(*self._fetch_command(lists))

    def _brpop_read(self, **options: Any) -> bool:
        connection = self.client.connection
        try:
            try:
                reply = self.client.parse_response(connection, "EVALSHA", **options)
            except self.connection_errors:
                # As kombu's BRPOP: reconnect on the next poll.
                connection.disconnect()
                raise
            except NoScriptError:
                self._in_poll = None
                self.client.script_load(script("fetch").text)
                raise Empty() from None
            except self.ResponseError as refused:
                # Redis refused the script (OOM, BUSY, READONLY ...): the message
                # is still queued (fetch.lua records before it pops).
                self._refuse("fetch", refused)
                raise Empty() from None
            if not reply:
                self._fetch_due = False
                raise Empty()
            self._fetch_due = True
            self._deliver_fetched(reply)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()  # type: ignore[attr-defined]

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

    def _deliver_fetched(self, reply: list[Any]) -> None:
        position, item, tag, kind = reply
        queue, name = self._fetching[int(position) - 1]
        if _bytes_to_str(kind) == "unreadable":
            try:
                taken = self._take_unreadable(queue, name, item)
            except self.ResponseError as refused:
                self._refuse("fetch", refused)
                raise Empty() from None
            if taken is None:
                raise Empty()  # taken by another consumer: the next poll fetches
            tag, payload = taken
        else:
            tag = _bytes_to_str(tag)
            payload = self._readable(item, tag, queue)
        self._queue_cycle.rotate(queue)
        self._recorded.add(tag)
        try:
            self.connection._deliver(payload, queue)
        finally:
            untaken = tag in self._recorded
            self._recorded.discard(tag)
        if untaken:
            # A consumer that takes no acknowledgements (no_ack) had it: it
            # leaves the broker at delivery, as with kombu's BRPOP.
            self.qos._remove_from_indices(tag).execute()  # type: ignore[attr-defined]

    def _take_unreadable(self, queue: str, name: str,
                         item: bytes) -> tuple[str, dict[str, Any]] | None:
        """Take an item fetch.lua could not read as a kombu envelope (and left
        queued) off list ``name`` (``fetch_checked.lua``): recorded as kombu
        records it when Python's json reads it as one after all, else as the
        :data:`UNREADABLE` envelope it is wrapped in. Its tag and the envelope
        to deliver, or None when another consumer took it first. A refusal
        (OOM ...) raises: the item is still queued."""
        envelope = self._envelope(item)
        if envelope is not None:
            tag = str(envelope["properties"]["delivery_tag"])
            exchange, routing_key = _routing(envelope, queue)
            # kombu's QoS.append record, the item kept as it was queued.
            record = b"".join((b"[", item, b", ", _dumps(exchange).encode(), b", ",
                               _dumps(routing_key).encode(), b"]"))
        else:
            tag = next(self._tags)
            envelope = unreadable_envelope(item, tag, queue)
            record = _dumps([envelope, "", queue]).encode()
        prefix = self.global_keyprefix
        keys = [prefix + self.unacked_key, prefix + self.unacked_index_key, prefix + name]
        args: list[str | bytes] = [repr(time()), tag, record, hashlib.sha1(item).hexdigest()]
        # Keys are prefixed already: a plain client, not kombu's prefixing one.
        plain = redis.Redis(connection_pool=self.pool)  # type: ignore[attr-defined]
        if not script("fetch_checked")(plain, keys, args):
            return None
        if envelope.get("content-type") == UNREADABLE:
            logger.warning("celery-tooleffect: a message in queue %s is no kombu envelope; "
                           "delivering it as %s (%d bytes)", queue, UNREADABLE, len(item))
        return tag, envelope

    def _envelope(self, item: bytes) -> dict[str, Any] | None:
        """``item`` as the kombu envelope Python's json reads, or None when kombu
        could not build a ``Message`` of it or restore it (not JSON, no
        ``properties`` or delivery tag, headers that are no mapping, a body
        that does not decode)."""
        try:
            payload = _loads(_bytes_to_str(item))
            properties = payload["properties"]
            if not isinstance(properties, Mapping):
                raise TypeError("properties is not a mapping")
            tag = properties.get("delivery_tag")
            if not isinstance(tag, str) or not tag:
                raise TypeError("no delivery tag")
            if not isinstance(properties.get("delivery_info"), Mapping):
                raise TypeError("delivery_info is not a mapping")
            if not isinstance(payload.get("headers", {}), Mapping):
                raise TypeError("headers is not a mapping")
            body = payload.get("body")
            if body:
                self.decode_body(body, properties.get("body_encoding"))  # type: ignore[attr-defined]
            return dict(payload)
        except Exception as unreadable:
            logger.debug("not a kombu envelope: %s: %s", type(unreadable).__name__, unreadable)
            return None

    def _readable(self, item: bytes, tag: str, queue: str) -> dict[str, Any]:
        """The envelope to deliver for an item fetch.lua recorded as a kombu
        envelope: the item, or, when kombu could not build a ``Message`` of it
        or restore it after all, the item wrapped as :data:`UNREADABLE`
        (recorded so in ``unacked`` too)."""
        envelope = self._envelope(item)
        if envelope is not None:
            return envelope
        logger.warning("celery-tooleffect: a message in queue %s is no kombu envelope; "
                       "delivering it as %s", queue, UNREADABLE)
        envelope = unreadable_envelope(item, tag, queue)
        self._record_again(tag, envelope, queue)
        return envelope

    def _record_again(self, tag: str, envelope: dict[str, Any], queue: str) -> None:
        """Replace the record of an item fetch.lua took for a kombu envelope (and
        recorded as it was) by the envelope delivered for it.

        cjson (in the script) reads some text as JSON that Python's json does not
        (hex numbers, control characters in strings ...), and a body may not
        decode: kombu's restore (``restore_by_tag``: ``loads`` the record, sets
        ``headers.redelivered``) would raise on such a record, or log it and
        drop the message, and a record it raises on stops every restore sweep
        that reaches it. The record stays a record all along (never neither);
        should this write fail, the message is still recorded as it was.
        """
        try:
            with self.conn_or_acquire() as client:  # type: ignore[attr-defined]
                # kombu's prefixing client: HSET gets global_keyprefix, as in QoS.append.
                client.hset(self.unacked_key, tag, _dumps([envelope, "", queue]))
        except Exception as failed:
            logger.error("celery-tooleffect: the unreadable message %s stays recorded as it "
                         "came (%s: %s); kombu cannot restore that record", tag,
                         type(failed).__name__, failed)

    def _get(self, queue: str) -> dict[str, Any]:
        # basic_get (Queue.get(), SimpleQueue): the same script, one queue.
        lists = [(queue, self._q_for_pri(queue, pri))  # type: ignore[attr-defined]
                 for pri in self.priority_steps]
        command = self._fetch_command(lists)
        plain = redis.Redis(connection_pool=self.pool)  # type: ignore[attr-defined]
        # Keys are prefixed already: a plain client, not kombu's prefixing one.
        reply = script("fetch")(plain, command[3:3 + command[2]], command[3 + command[2]:])
        with self.conn_or_acquire() as client:  # type: ignore[attr-defined]
            self._maybe_update_queues_expire(client, queue)  # type: ignore[attr-defined]
        if not reply:
            raise Empty()
        position, item, tag, kind = reply
        if _bytes_to_str(kind) == "unreadable":
            taken = self._take_unreadable(queue, lists[int(position) - 1][1], item)
            if taken is None:
                raise Empty()  # taken by another consumer meanwhile
            tag, payload = taken
        else:
            tag = _bytes_to_str(tag)
            payload = self._readable(item, tag, queue)
        self._recorded.add(tag)
        return payload

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)  # type: ignore[misc]
        if message is not None and message.delivery_tag in self._recorded:
            self._recorded.discard(message.delivery_tag)
            self.qos._remove_from_indices(message.delivery_tag).execute()  # type: ignore[attr-defined]
        return message

    def _update_queue_cycle(self) -> None:
        super()._update_queue_cycle()  # type: ignore[misc]
        # A queue was added or cancelled: fetch over the new set of lists at once.
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


class Channel(AtomicFetch, kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel with the atomic fetch."""


class SentinelChannel(AtomicFetch, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """kombu's Redis Sentinel channel with the atomic fetch."""


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
            if isinstance(channel, AtomicFetch) and channel.health_check_interval:
                channel._check_waits(channel.health_check_interval)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the atomic fetch."""

    Channel = Channel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.cycle = Poller()  # type: ignore[assignment]


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Redis Sentinel transport with the atomic fetch."""

    Channel = SentinelChannel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.cycle = Poller()  # type: ignore[assignment]


#: kombu's transport classes and the ones with the atomic fetch that replace them.
ATOMIC: dict[type, type] = {
    kombu_redis.Transport: Transport,
    kombu_redis.SentinelTransport: SentinelTransport,
}
