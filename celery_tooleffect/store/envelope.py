"""The message a dead letter keeps: exactly what the broker delivered.

:class:`MessageEnvelope` is built by one function, :meth:`MessageEnvelope.of_message`,
from the kombu ``Message`` a worker received, wherever the letter is written
(the request class in the worker's main process for every tool ending, and the
consumer step for messages Celery refuses). It keeps:

- the body as bytes, whatever they are (stored base64-encoded, so bytes that
  are not UTF-8 survive);
- the content type and content encoding;
- every header (protocol 2 headers, canvas fields, ``traceparent`` and any
  custom producer header), including ``compression``;
- the message properties (``correlation_id``, ``reply_to``, ``priority``,
  ``delivery_mode``, ``expiration`` ...), less those a transport owns
  (the delivery tag, Redis's ``delivery_info`` and ``body_encoding``);
- where it was routed: exchange and routing key.

Compression: kombu decompresses a body when it builds the ``Message``
(``kombu.message.Message.__init__`` reads the ``compression`` header), so the
body kept is the decompressed one and the ``compression`` header stays. A
replay hands the body and that header's method to kombu's producer, which
compresses it again, as the original producer did. A body kombu could not
decompress is kept as it came (``body_compressed``) and published unchanged.

Headers and properties are stored as JSON with a tag for each value JSON has
no type for (bytes, datetime, date, time, Decimal, UUID, and dicts whose keys
are not plain text), so they read back equal and of the same types.

A replay (:meth:`MessageEnvelope.replayed`) changes only what it must: the
retry count back to 0, ``eta`` and ``expires`` dropped, and the header
:data:`REPLAY_HEADER` that marks the replay (the audit event holds who and
why). Protocol 1 messages carry those fields in the body, which a replay
never re-encodes: they are published as they are.

What operators are shown (:meth:`MessageEnvelope.decoded`) is decoded from
the body with kombu's serializer registry, only for the content types the app
accepts, and never written back.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kombu.serialization import loads, prepare_accept_content

#: Header a replay sets on the message it publishes (informational: the
#: worker decides from the journal, never from this header).
REPLAY_HEADER = "tooleffect_replayed"

#: Message properties that belong to a transport, not to the message: kombu's
#: Redis channel sets the delivery tag, ``delivery_info`` and
#: ``body_encoding`` again on every publish; py-amqp carries the headers and
#: content type in its properties too.
TRANSPORT_PROPERTIES = frozenset({
    "delivery_tag",
    "delivery_info",
    "body_encoding",
    "application_headers",
    "headers",
    "content_type",
    "content_encoding",
})

#: Properties kombu's ``Producer.publish`` takes as named arguments.
_NAMED_PROPERTIES = ("priority", "delivery_mode", "expiration")


@dataclass(frozen=True)
class MessageEnvelope:
    """One broker message, as it was delivered."""

    body: bytes
    content_type: str | None
    content_encoding: str | None
    headers: Mapping[str, Any] = field(default_factory=dict)
    properties: Mapping[str, Any] = field(default_factory=dict)
    exchange: str = ""
    routing_key: str = ""
    #: The body is still compressed (kombu failed to decompress it).
    body_compressed: bool = False

    @classmethod
    def of_message(cls, message: Any) -> MessageEnvelope:
        """The envelope of a kombu ``Message`` (any transport)."""
        body = getattr(message, "body", b"")
        if body is None:
            body = b""
        elif isinstance(body, str):
            body = body.encode(getattr(message, "content_encoding", None) or "utf-8")
        else:
            body = bytes(body)
        headers = dict(_mapping(getattr(message, "headers", None)))
        properties = {
            name: value
            for name, value in _mapping(getattr(message, "properties", None)).items()
            if name not in TRANSPORT_PROPERTIES
        }
        delivery_info = _mapping(getattr(message, "delivery_info", None))
        failed_decompression = bool(headers.get("compression")) and bool(
            getattr(message, "errors", None)
        )
        return cls(
            body=body,
            content_type=_text(getattr(message, "content_type", None)),
            content_encoding=_text(getattr(message, "content_encoding", None)),
            headers=headers,
            properties=properties,
            exchange=str(delivery_info.get("exchange") or ""),
            routing_key=str(delivery_info.get("routing_key") or ""),
            body_compressed=failed_decompression,
        )

    # -- what it says ----------------------------------------------------------

    @property
    def protocol(self) -> int:
        """Celery's task message protocol: 2 names the task in a header, 1 in the body."""
        return 2 if "task" in self.headers else 1

    def decoded(self, accept: Any) -> Any:
        """The body decoded with kombu's serializers, for display only.

        ``accept`` is the app's ``accept_content``: a content type the workers
        would refuse (pickle, unless accepted) is not decoded here either.
        Raises what kombu raises (``ContentDisallowed``, ``DecodeError`` ...).
        """
        if self.body_compressed:
            raise ValueError("the body could not be decompressed")
        allowed = prepare_accept_content(accept)  # type: ignore[no-untyped-call]
        return loads(  # type: ignore[no-untyped-call]
            self.body, self.content_type, self.content_encoding, accept=allowed
        )

    def task_payload(self, accept: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
        """``(args, kwargs, embed)`` of the task message, decoded for display
        only (:meth:`decoded`); ``embed`` holds the canvas fields of a protocol
        2 body (``callbacks``, ``errbacks``, ``chain``, ``chord``). Raises what
        kombu raises, or ``ValueError`` for a body that is no task's."""
        body = self.decoded(accept)
        if isinstance(body, (list, tuple)) and len(body) == 3:
            args, kwargs, embed = body
        elif isinstance(body, Mapping):  # protocol 1
            args, kwargs, embed = body.get("args"), body.get("kwargs"), {}
        else:
            raise ValueError(f"not a task body: {type(body).__name__}")
        return (
            list(args) if isinstance(args, (list, tuple)) else [],
            dict(kwargs) if isinstance(kwargs, Mapping) else {},
            dict(embed) if isinstance(embed, Mapping) else {},
        )

    # -- replay ----------------------------------------------------------------

    def replayed(self, mark: str) -> MessageEnvelope:
        """This message as a replay publishes it (see the module docs)."""
        headers = dict(self.headers)
        if self.protocol == 2:
            headers["retries"] = 0
            headers["eta"] = None
            headers["expires"] = None
        headers[REPLAY_HEADER] = mark
        return MessageEnvelope(
            body=self.body, content_type=self.content_type,
            content_encoding=self.content_encoding, headers=headers,
            properties=dict(self.properties), exchange=self.exchange,
            routing_key=self.routing_key, body_compressed=self.body_compressed,
        )

    def publish(self, producer: Any, *, declare: list[Any] | None = None) -> None:
        """Publish this message with kombu ``producer``: the same bytes, headers and properties."""
        headers = dict(self.headers)
        compression = None
        if not self.body_compressed:
            # kombu compresses again and sets the header itself.
            compression = headers.pop("compression", None)
        properties = dict(self.properties)
        named: dict[str, Any] = {name: properties.pop(name) for name in _NAMED_PROPERTIES
                                 if properties.get(name) is not None}
        if "expiration" in named:
            # AMQP keeps it as text milliseconds; kombu takes seconds.
            named["expiration"] = int(str(named["expiration"])) / 1000.0
        producer.publish(
            self.body,
            exchange=self.exchange,
            routing_key=self.routing_key,
            headers=headers,
            content_type=self.content_type or "application/data",
            content_encoding=self.content_encoding or "binary",
            compression=compression,
            declare=declare or [],
            retry=True,
            **named,
            **properties,
        )

    # -- storage ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form, read back equal by :meth:`from_dict`."""
        return {
            "body": base64.b64encode(self.body).decode("ascii"),
            "content_type": self.content_type,
            "content_encoding": self.content_encoding,
            "headers": tag(dict(self.headers)),
            "properties": tag(dict(self.properties)),
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "body_compressed": self.body_compressed,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MessageEnvelope:
        return cls(
            body=base64.b64decode(data.get("body") or ""),
            content_type=data.get("content_type"),
            content_encoding=data.get("content_encoding"),
            headers=untag(data.get("headers") or {}),
            properties=untag(data.get("properties") or {}),
            exchange=str(data.get("exchange") or ""),
            routing_key=str(data.get("routing_key") or ""),
            body_compressed=bool(data.get("body_compressed")),
        )


# -- tagged JSON: values JSON has no type for, kept exactly ------------------------

_TAG = "$te"


def tag(value: Any) -> Any:
    """``value`` as JSON-safe data that :func:`untag` turns back into an equal value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_TAG: "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, datetime.datetime):
        return {_TAG: "datetime", "v": value.isoformat()}
    if isinstance(value, datetime.date):
        return {_TAG: "date", "v": value.isoformat()}
    if isinstance(value, datetime.time):
        return {_TAG: "time", "v": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {_TAG: "decimal", "v": str(value)}
    if isinstance(value, uuid.UUID):
        return {_TAG: "uuid", "v": str(value)}
    if isinstance(value, (list, tuple)):
        return [tag(item) for item in value]
    if isinstance(value, Mapping):
        if all(isinstance(key, str) for key in value) and _TAG not in value:
            return {key: tag(item) for key, item in value.items()}
        return {_TAG: "map", "v": [[tag(key), tag(item)] for key, item in value.items()]}
    raise TypeError(f"a message header or property of type {type(value).__name__} "
                    "cannot be kept")


def untag(value: Any) -> Any:
    """The value :func:`tag` was given."""
    if isinstance(value, list):
        return [untag(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {key: untag(item) for key, item in value.items()}
    text = value.get("v")
    if kind == "bytes":
        return base64.b64decode(text or "")
    if kind == "datetime":
        return datetime.datetime.fromisoformat(str(text))
    if kind == "date":
        return datetime.date.fromisoformat(str(text))
    if kind == "time":
        return datetime.time.fromisoformat(str(text))
    if kind == "decimal":
        return decimal.Decimal(str(text))
    if kind == "uuid":
        return uuid.UUID(str(text))
    if kind == "map":
        return {untag(key): untag(item) for key, item in text or []}
    raise ValueError(f"unknown tag {kind!r} in a stored message")


# -- what operators are shown -------------------------------------------------------


def shown(value: Any) -> Any:
    """``value`` as JSON can show it: a value JSON has no type for becomes text, marked
    ``{"$text": ..., "$type": ...}``. For display only: never written back."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) \
            else _as_text(value)
    if isinstance(value, (list, tuple)):
        return [shown(item) for item in value]
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return {key: shown(item) for key, item in value.items()}
    return _as_text(value)


def _as_text(value: Any) -> dict[str, str]:
    kind = type(value)
    try:
        text = repr(value)
    except Exception:
        text = f"<unprintable {kind.__name__}>"
    return {"$text": text, "$type": f"{kind.__module__}.{kind.__qualname__}"}


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
