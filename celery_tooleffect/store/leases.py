"""Leases: how long a running write may keep its message and its journal entry.

Two leases guard a write with an ``operation_deadline``:

- the **broker lease**: on kombu's Redis transport a message is restored (and so
  delivered again) once its score in ``unacked_index`` is older than
  ``now - visibility_timeout``. Before the body starts, the score is raised so
  that the message stays put until the deadline; the write does not start if
  that fails. On transports without leases (RabbitMQ, memory) this is a no-op.
- the **journal lease**: ``lease_end`` of the journal entry says how long the
  owner is presumed alive. It is kept short and renewed by a heartbeat while
  the body runs (:mod:`celery_tooleffect.worker.heartbeat`), never past the
  deadline, so a worker that died is noticed soon after, and not only when
  the deadline passes.

"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import redis

from ..choices import Choice
from ..settings import Settings
from .connections import client_for
from .lua import script

logger = logging.getLogger(__name__)


class LeaseVerdict(Choice):
    """The answer of one extension of a broker lease."""

    __choice_name__ = "a lease verdict"

    OK = "ok"
    BUSY = "busy"
    LOST = "lost"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class BrokerLease:
    """The lease of one delivered message on kombu's Redis transport."""

    tag: str
    index_key: str
    mutex_key: str
    visibility_timeout: float
    #: The broker's database when it is not the store's: a store script that
    #: secures this lease selects it (``Journal.begin_attempt``); None when it
    #: is the store's, or when no store script can reach the broker.
    db: int | None = None

    def score_for(self, lease_end: float) -> float:
        """The ``unacked_index`` score that keeps the message until ``lease_end``."""
        return lease_end - self.visibility_timeout


@dataclass(frozen=True)
class BrokerAck:
    """The acknowledgement of one delivered message on kombu's Redis transport,
    done by a store script (what ``QoS.ack`` does: ``ZREM unacked_index`` and
    ``HDEL unacked``), so that the message leaves ``unacked`` in the same
    atomic step that records how its call ended."""

    tag: str
    unacked_key: str
    index_key: str
    #: The broker's database when it is not the store's (one server, several
    #: databases: the script selects it for the acknowledgement); None when
    #: it is the store's.
    db: int | None = None


class Leases:
    """Extends broker leases of one app's messages."""

    #: How often, and how long apart, a BUSY answer is tried again.
    BUSY_RETRIES = 40
    BUSY_WAIT = 0.05

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        options = settings.broker_transport_options
        prefix = str(options.get("global_keyprefix", ""))
        # kombu's prefixed client does not prefix every command (ZADD in a
        # script, for one), so the prefix is added here.
        self._index_key = prefix + str(options.get("unacked_index_key", "unacked_index"))
        self._mutex_key = prefix + str(options.get("unacked_mutex_key", "unacked_mutex"))
        self._unacked_key = prefix + str(options.get("unacked_key", "unacked"))

    @property
    def supported(self) -> bool:
        """Whether the broker has leases to extend (kombu's Redis transport)."""
        return self.settings.broker_is_redis

    @cached_property
    def shares_the_store(self) -> bool:
        """Whether the broker is the store's Redis (same server, database and
        user, no cluster): a broker lease can then be secured by the store's
        own scripts, in the round trip of the intent."""
        settings = self.settings
        # A failover list's leases and records are both on its first server,
        # but kombu may have moved the broker on: a separate lease call then.
        broker = settings.broker_redis
        if broker is None or settings.redis_cluster or (
                ";" in settings.broker_url and not broker.behind_sentinel):
            return False
        return broker.identity() == settings.store_endpoint.identity()

    @cached_property
    def reaches_the_broker(self) -> bool:
        """Whether the store's scripts can reach the broker's keys (acknowledge
        a message, secure its lease): the broker is on the store's server as
        the same user (no cluster, not a failover list), in the store's
        database or another one (the script then selects the broker's: on
        Redis a script's ``SELECT`` is its own and leaves the connection's
        database as it was)."""
        settings = self.settings
        broker = settings.broker_redis
        if broker is None or settings.redis_cluster or settings.store_endpoint.cluster or (
                ";" in settings.broker_url and not broker.behind_sentinel):
            return False
        return broker.reach() == settings.store_endpoint.reach()

    @cached_property
    def _ack_db(self) -> int | None:
        broker = self.settings.broker_redis
        if broker is None or broker.db == self.settings.store_endpoint.db:
            return None
        return broker.db

    @property
    def client(self) -> redis.Redis:
        assert self.settings.broker_redis is not None, "leases need a Redis broker"
        return client_for(self.settings.broker_redis, self.settings.socket_timeout)

    def broker_lease(self, properties: Mapping[str, Any] | None) -> BrokerLease | None:
        """The lease of the message with these properties; None without one."""
        tag = (properties or {}).get("delivery_tag")
        if not self.supported or tag is None:
            return None
        return BrokerLease(
            tag=str(tag),
            index_key=self._index_key,
            mutex_key=self._mutex_key,
            visibility_timeout=self.settings.visibility_timeout,
            db=self._ack_db if self.reaches_the_broker else None,
        )

    def broker_ack(self, properties: Mapping[str, Any] | None) -> BrokerAck | None:
        """The acknowledgement a store script can do for the message with these
        properties: only when the broker is on the store's Redis server
        (:attr:`reaches_the_broker`), else None."""
        tag = (properties or {}).get("delivery_tag")
        if tag is None or not self.supported or not self.reaches_the_broker:
            return None
        return BrokerAck(str(tag), self._unacked_key, self._index_key, self._ack_db)

    def acknowledge(self, ack: BrokerAck) -> None:
        """Acknowledge the message alone (when no script could carry it), on
        the broker's own connection (its database)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(ack.index_key, ack.tag)
        pipe.hdel(ack.unacked_key, ack.tag)
        pipe.execute()

    def extend_lease(self, lease: BrokerLease, lease_end: float) -> LeaseVerdict:
        """Keep the message until ``lease_end``; waits out a running restore sweep."""
        for _ in range(self.BUSY_RETRIES):
            try:
                answer = script("extend_lease")(
                    self.client,
                    [lease.mutex_key, lease.index_key],
                    [lease.tag, f"{lease.score_for(lease_end):.6f}"],
                )
            except redis.RedisError as exc:
                logger.warning("broker lease of %s not extended: %s", lease.tag, exc)
                return LeaseVerdict.UNAVAILABLE
            verdict = LeaseVerdict.coerce(
                answer.decode() if isinstance(answer, bytes) else str(answer)
            )
            if verdict is not LeaseVerdict.BUSY:
                return verdict
            time.sleep(self.BUSY_WAIT)
        return LeaseVerdict.BUSY
