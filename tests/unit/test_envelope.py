"""The message a dead letter keeps (celery_tooleffect/store/envelope.py): built
from a real kombu ``Message`` (no channel, no broker), stored as JSON and read
back equal, replayed changing only what a replay must."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu import compression
from kombu.exceptions import ContentDisallowed
from kombu.message import Message
from kombu.serialization import dumps

from celery_tooleffect.store.envelope import (
    REPLAY_HEADER,
    TRANSPORT_PROPERTIES,
    MessageEnvelope,
    shown,
    tag,
    untag,
)

PROPERTIES = settings(max_examples=80, deadline=None, database=None)


def protocol_2(**headers: Any) -> dict[str, Any]:
    return {"lang": "py", "task": "tools.t", "id": "t-1", "root_id": "t-1", "parent_id": None,
            "group": None, "retries": 2, "eta": "2030-01-01T00:00:00+00:00",
            "expires": "2030-01-02T00:00:00+00:00", "traceparent": "00-abc-def-01",
            **headers}


def message(body: Any = b'[["k"], {}, {}]', **fields: Any) -> Message:
    fields.setdefault("content_type", "application/json")
    fields.setdefault("content_encoding", "utf-8")
    fields.setdefault("headers", protocol_2())
    fields.setdefault("properties", {
        "delivery_tag": "tag-1", "correlation_id": "t-1", "reply_to": "r", "priority": 3,
        "delivery_mode": 2, "delivery_info": {"exchange": ""}, "body_encoding": "base64",
        "application_headers": {}, "headers": {}, "content_type": "x", "expiration": "60000"})
    fields.setdefault("delivery_info", {"exchange": "tools", "routing_key": "tools.rk",
                                        "redelivered": True})
    return Message(body=body, **fields)  # type: ignore[no-untyped-call]


def test_the_envelope_keeps_the_message_as_delivered_less_the_transport_s_fields() -> None:
    envelope = MessageEnvelope.of_message(message())
    assert envelope.body == b'[["k"], {}, {}]'
    assert (envelope.content_type, envelope.content_encoding) == ("application/json", "utf-8")
    assert envelope.headers == protocol_2()
    assert envelope.properties == {"correlation_id": "t-1", "reply_to": "r", "priority": 3,
                                   "delivery_mode": 2, "expiration": "60000"}
    assert not set(envelope.properties) & TRANSPORT_PROPERTIES
    assert (envelope.exchange, envelope.routing_key) == ("tools", "tools.rk")
    assert envelope.protocol == 2 and not envelope.body_compressed


def test_what_a_message_may_lack_is_kept_as_nothing() -> None:
    bare = MessageEnvelope.of_message(Message(body=None))  # type: ignore[no-untyped-call]
    assert bare == MessageEnvelope(body=b"", content_type=None, content_encoding=None)
    assert bare.protocol == 1  # no task header: the task is named in the body
    text = MessageEnvelope.of_message(
        Message(body="é", content_encoding="latin-1"))  # type: ignore[no-untyped-call]
    assert text.body == "é".encode("latin-1")

    class Odd:  # not a kombu Message: whatever it lacks is nothing
        body = bytearray(b"\xff\x00")
        headers = "not a mapping"
        properties = None
        delivery_info = None

    odd = MessageEnvelope.of_message(Odd())
    assert odd.body == b"\xff\x00" and odd.headers == {} and odd.routing_key == ""


def test_a_compressed_body_is_kept_decompressed_with_its_header() -> None:
    compressed, method = compression.compress(  # type: ignore[no-untyped-call]
        b'[["k"], {}, {}]', "zlib")
    envelope = MessageEnvelope.of_message(message(compressed, headers=protocol_2(
        compression=method)))
    assert envelope.body == b'[["k"], {}, {}]' and not envelope.body_compressed
    assert envelope.headers["compression"] == method
    assert envelope.decoded(["json"]) == [["k"], {}, {}]


def test_a_body_kombu_could_not_decompress_is_kept_as_it_came() -> None:
    envelope = MessageEnvelope.of_message(message(b"not zlib", headers=protocol_2(
        compression="application/x-gzip")))
    assert envelope.body == b"not zlib" and envelope.body_compressed
    with pytest.raises(ValueError, match="could not be decompressed"):
        envelope.decoded(["json"])


def test_only_the_content_types_the_app_accepts_are_decoded() -> None:
    content_type, encoding, body = dumps({"a": 1}, serializer="pickle")  # type: ignore[no-untyped-call]
    pickled = MessageEnvelope(body=body, content_type=content_type, content_encoding=encoding)
    with pytest.raises(ContentDisallowed):
        pickled.decoded(["json"])
    assert pickled.decoded(["json", "pickle"]) == {"a": 1}


def test_a_replay_changes_only_what_it_must() -> None:
    original = MessageEnvelope.of_message(message())
    replayed = original.replayed("by ops: fixed the provider")
    assert replayed.headers == {**protocol_2(), "retries": 0, "eta": None, "expires": None,
                                REPLAY_HEADER: "by ops: fixed the provider"}
    assert (replayed.body, replayed.properties, replayed.exchange, replayed.routing_key) == (
        original.body, original.properties, original.exchange, original.routing_key)
    assert original.headers == protocol_2()  # the letter's own copy is untouched
    # Protocol 1 carries retries and eta in the body, which a replay never re-encodes.
    old = MessageEnvelope(body=b"{}", content_type="application/json", content_encoding="utf-8",
                          headers={"x": 1})
    assert old.replayed("m").headers == {"x": 1, REPLAY_HEADER: "m"}


class Producer:
    def __init__(self) -> None:
        self.published: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **options: Any) -> None:
        self.published.append((body, options))


def test_a_replay_publishes_the_same_bytes_headers_and_properties() -> None:
    compressed, method = compression.compress(  # type: ignore[no-untyped-call]
        b'[["k"], {}, {}]', "zlib")
    envelope = MessageEnvelope.of_message(message(compressed, headers=protocol_2(
        compression=method)))
    producer = Producer()
    envelope.publish(producer, declare=["queue"])
    ((body, options),) = producer.published
    assert body == b'[["k"], {}, {}]'
    # kombu compresses it again and sets the header itself.
    assert options["compression"] == method and "compression" not in options["headers"]
    assert options["headers"] == protocol_2()
    assert (options["exchange"], options["routing_key"]) == ("tools", "tools.rk")
    assert (options["priority"], options["delivery_mode"]) == (3, 2)
    assert options["expiration"] == 60.0  # AMQP's milliseconds, as kombu's seconds
    assert (options["correlation_id"], options["reply_to"]) == ("t-1", "r")
    assert options["declare"] == ["queue"] and options["retry"] is True


def test_a_body_still_compressed_is_published_unchanged_with_its_header() -> None:
    envelope = MessageEnvelope(body=b"raw", content_type=None, content_encoding=None,
                               headers={"compression": "application/x-gzip"},
                               body_compressed=True)
    producer = Producer()
    envelope.publish(producer)
    ((body, options),) = producer.published
    assert body == b"raw" and options["compression"] is None
    assert options["headers"] == {"compression": "application/x-gzip"}
    assert (options["content_type"], options["content_encoding"]) == ("application/data",
                                                                      "binary")
    assert options["declare"] == []


# -- stored as JSON, read back equal ------------------------------------------------------


KEYS = st.text(max_size=8)
SCALARS = (st.none() | st.booleans() | st.integers() | st.text(max_size=20)
           | st.floats(allow_nan=False) | st.binary(max_size=20)
           | st.datetimes(timezones=st.none() | st.just(datetime.timezone.utc))
           | st.dates() | st.times() | st.uuids()
           | st.decimals(allow_nan=False, allow_infinity=False))
VALUES = st.recursive(
    SCALARS,
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(KEYS, inner, max_size=4)
                   # keys JSON cannot hold, and a user's own "$te" key
                   | st.dictionaries(st.integers() | st.binary(max_size=4) | st.just("$te"),
                                     inner, max_size=3)),
    max_leaves=12,
)


@PROPERTIES
@given(headers=st.dictionaries(KEYS, VALUES, max_size=6),
       properties=st.dictionaries(KEYS, VALUES, max_size=4), body=st.binary(max_size=64),
       compressed=st.booleans())
def test_an_envelope_is_read_back_equal_from_its_json(headers: dict[str, Any],
                                                      properties: dict[str, Any], body: bytes,
                                                      compressed: bool) -> None:
    envelope = MessageEnvelope(body=body, content_type="application/x-test",
                               content_encoding="binary", headers=headers,
                               properties=properties, exchange="e", routing_key="r",
                               body_compressed=compressed)
    stored = json.loads(json.dumps(envelope.to_dict()))
    assert MessageEnvelope.from_dict(stored) == envelope


@PROPERTIES
@given(VALUES)
def test_tag_and_untag_keep_every_value_and_its_type(value: Any) -> None:
    back = untag(json.loads(json.dumps(tag(value))))
    assert back == value
    assert type(back) is type(value)


def test_tuples_come_back_as_lists_as_json_gives_them() -> None:
    assert untag(tag((1, (b"x", 2)))) == [1, [b"x", 2]]


def test_a_value_that_cannot_be_kept_is_refused_and_an_unknown_tag_is_refused() -> None:
    with pytest.raises(TypeError, match="of type object cannot be kept"):
        tag({"x": object()})
    with pytest.raises(ValueError, match="unknown tag 'pickle'"):
        untag({"$te": "pickle", "v": "..."})
    assert MessageEnvelope.from_dict({}) == MessageEnvelope(b"", None, None)


# -- what operators are shown --------------------------------------------------------


def test_shown_turns_what_json_cannot_show_into_marked_text() -> None:
    assert shown({"a": [1, "x", None, True, 1.5]}) == {"a": [1, "x", None, True, 1.5]}
    assert shown(b"\x00") == {"$text": "b'\\x00'", "$type": "builtins.bytes"}
    assert shown((1, 2)) == [1, 2]
    assert shown({1: "x"}) == {"$text": "{1: 'x'}", "$type": "builtins.dict"}
    assert shown(decimal.Decimal("1.5"))["$type"] == "decimal.Decimal"
    for value in (math.nan, math.inf, -math.inf):
        assert shown(value)["$type"] == "builtins.float"

    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert shown(Unprintable())["$text"] == "<unprintable Unprintable>"


@PROPERTIES
@given(VALUES)
def test_whatever_a_message_holds_can_be_shown_as_json(value: Any) -> None:
    json.dumps(shown(value), allow_nan=False)


def test_uuid_and_date_values_are_tagged_by_type() -> None:
    key = uuid.UUID(int=7)
    assert tag(key) == {"$te": "uuid", "v": str(key)}
    assert tag(datetime.date(2030, 1, 2)) == {"$te": "date", "v": "2030-01-02"}
    assert tag({"$te": 1}) == {"$te": "map", "v": [["$te", 1]]}
