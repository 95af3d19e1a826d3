"""kombu's Redis transport with an atomic fetch: no message is lost in the fetch.

kombu's Redis transport (``kombu/transport/redis.py``, 5.7) takes a message
off its queue with ``BRPOP`` and records it as unacknowledged only afterwards
(``QoS.append``: ``ZADD unacked_index`` and ``HSET unacked``, a second round
trip). A worker killed between the two loses the message without a trace
(kombu #305, celery #4354, celery #1392). Here one Lua script
(``store/scripts/fetch.lua``) does both, in kombu's own format, so that kombu's
restore, ``visibility_timeout``, ``unacked_mutex`` and acknowledgement, and
the package's leases, work on the record unchanged:

- **Order.** The script tries the lists in the order kombu's ``BRPOP`` names
  them (every priority step of every queue, the queues in the channel's
  ``queue_order_strategy`` cycle, rotated after each message as kombu rotates
  it), honouring ``global_keyprefix``, ``sep`` and ``priority_steps``.
- **Blocking without polling.** When every list is empty, the channel waits
  for one of them to fill and then runs the script again
  (:mod:`celery_tooleffect.worker.transport_waits`). While messages are
  waiting, no wait is sent: each fetch is one round trip.
- **What stays kombu's.** Publishing, fanout and pidbox (``celery inspect``,
  ``revoke`` broadcasts), restore, acknowledgement, reject and requeue.
  Messages of plain kombu producers are consumed as they are; a worker with
  this fetch and one without can share queues (both keep the same records).
- **Bad input.** An item that is no kombu envelope is recorded and delivered
  as an envelope of content type ``UNREADABLE``, whose body is the item's
  bytes: the package's consumer step stores it as a dead letter, and it never
  stops the consumer (:mod:`celery_tooleffect.worker.transport_unreadable`).
- **Failures.** The script records the message before it pops it (a write
  refused half-way, as under ``maxmemory``, leaves it queued); a refused or
  failed script, or a refused wait, is logged and tried again a second later
  (:mod:`celery_tooleffect.worker.transport_waits`). A cut connection after
  the script ran leaves the message in ``unacked``, where kombu's restore
  finds it after the visibility timeout.

:class:`Transport` and :class:`SentinelTransport` are what an app that uses the
package connects with (``celery_tooleffect.worker.fetch`` chooses them; the
setting ``tooleffect_atomic_fetch = False`` keeps kombu's own). Needs Redis
6.2 or newer (``BLMOVE``), as the package's leases do (``ZADD GT``).
"""

from __future__ import annotations

import contextlib
from queue import Empty
from time import monotonic, time
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from redis.exceptions import NoScriptError

from ..store.lua import script
from .transport_unreadable import UnreadableItems
from .transport_waits import ListWaits, Poller

# kombu's helper is untyped; called through this.
_bytes_to_str: Any = bytes_to_str


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


class AtomicFetch(UnreadableItems, ListWaits):
    """The fetch of a kombu Redis channel, made atomic (mixed into kombu's
    ``Channel`` and ``SentinelChannel``): the fetch here, the waits between
    fetches in :class:`ListWaits`, the items that are no kombu envelope in
    :class:`UnreadableItems`."""

    QoS = QoS

    # kombu's Channel attributes this mixin uses (typed here for mypy).
    active_queues: list[str]
    priority_steps: list[int]
    global_keyprefix: str
    unacked_key: str
    unacked_index_key: str
    brpop_timeout: float
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
        #: (queue, list) of each list of the fetch in flight.
        self._fetching: list[tuple[str, str]] = []
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

    def close(self) -> None:
        # kombu's close reads a fetch still in flight first, and stops there
        # when that read raises (the connection is gone): the channel stays
        # open with its clients, and the next close (Celery 5.7's consumer
        # closes its connection after collect() cleared the transport's
        # client) fails to build a client for kombu's restore
        # (AttributeError), which stops the worker. Read it here, and let a
        # lost connection end the read, not the close.
        if self._in_poll:
            with contextlib.suppress(Empty, *self.connection_errors):
                self._brpop_read()
            self._in_poll = None
        super().close()  # type: ignore[misc]


class Channel(AtomicFetch, kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel with the atomic fetch."""


class SentinelChannel(AtomicFetch, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """kombu's Redis Sentinel channel with the atomic fetch."""


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
