"""Queue items that are no kombu envelope: how the atomic fetch takes and delivers them.

An item on a queue that is no kombu envelope (not JSON, not an object, no
``properties``, no delivery tag, headers that are no object, a body kombu
cannot decode) is recorded under a tag of its own as a kombu envelope of
content type :data:`UNREADABLE` whose body is the item's bytes, untouched, and
delivered: Celery's consumer cannot decode it and the package's consumer step
stores it as a dead letter (``undecodable_message``). It never stops the
consumer, and kombu's restore (which expects JSON in ``unacked``, and headers
it can mark redelivered) never meets it.

Such an item takes a second round trip, still atomic: ``fetch.lua`` leaves it
queued and returns it, the worker reads it with Python's json (an envelope
after all, as one with a lone surrogate, which cjson refuses, is taken as it
is) or wraps it (base64 in Lua blocked Redis for seconds on a large item), and
``fetch_checked.lua`` records it so and pops it if it is still the list's next
item. An item the first script took for an envelope (cjson reads more than
Python's json) but that Python cannot read is recorded again so before it is
delivered.

:class:`UnreadableItems` is mixed into the atomic fetch's channel
(:class:`celery_tooleffect.worker.transport.AtomicFetch`).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import uuid
from collections.abc import Iterator, Mapping
from time import time
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from ..store.lua import script

# The transport's logger: what the atomic fetch logs keeps one name, whichever
# of its modules logs it (log configurations name it).
logger = logging.getLogger("celery_tooleffect.worker.transport")

# kombu's helpers are untyped; called through these.
_bytes_to_str: Any = bytes_to_str
_dumps: Any = dumps
_loads: Any = loads

#: The content type of the envelope an item that is no kombu envelope is
#: delivered (and recorded) in: its body is the item's bytes as they were
#: queued. Celery's consumer cannot decode it and hands it to on_decode_error,
#: where the package dead-letters it with those bytes as its body; kombu's
#: restore puts the envelope, valid JSON, back on the queue.
UNREADABLE = "application/x-tooleffect-unreadable"


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


class UnreadableItems:
    """How a channel of the atomic fetch takes, records and delivers a queue
    item that is no kombu envelope (mixed into
    :class:`~celery_tooleffect.worker.transport.AtomicFetch`)."""

    # kombu's Channel attributes this mixin uses (typed here for mypy).
    global_keyprefix: str
    unacked_key: str
    unacked_index_key: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        prefix = uuid.uuid4().hex
        #: The tags of the items recorded as :data:`UNREADABLE` envelopes.
        self._tags: Iterator[str] = (f"{prefix}.{n}" for n in itertools.count())
        super().__init__(*args, **kwargs)

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
        # SHA-1: fetch_checked.lua compares it with redis.sha1hex, the only
        # digest Redis's Lua has (a fingerprint, not a security check).
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
