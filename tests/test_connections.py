"""The hot path's own packing and round trip (``celery_tooleffect.store.connections``)."""

from __future__ import annotations

import pytest
import redis
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError, ResponseError

from celery_tooleffect.store import connections
from celery_tooleffect.store.connections import one_round_trip, pack, pack_python, redis_client
from tests.conftest import REDIS_URL


def test_pack_writes_what_redis_py_writes_for_text_bytes_and_numbers() -> None:
    command = ("XADD", "stream", "MAXLEN", "~", 1000, "*", "ts", 1.25, "size", b"\x00\xff",
               "name", "caf\u00e9 \U0001f642")
    expected = b"".join(PythonRespSerializer(6000, redis.connection.Encoder(
        "utf-8", "strict", False).encode).pack(*command))
    assert pack([command]) == expected
    assert pack([("PING",), ("PING",)]) == b"*1\r\n$4\r\nPING\r\n" * 2
    # A command name with a space goes as two words, as redis-py sends it.
    assert pack([("CONFIG GET", "maxmemory")]) == pack([("CONFIG", "GET", "maxmemory")])
    assert pack([("SET", "k", memoryview(b"v"))]) == pack([("SET", "k", b"v")])


def test_hiredis_packs_the_same_bytes_and_leaves_it_what_it_refuses() -> None:
    """The C packer (the suite runs with hiredis) writes what the Python one
    does, numbers included; text that is not UTF-8, a str subclass, a
    bytearray or a spaced name go through Python, in one buffer."""
    assert connections.c_pack is not None

    class Name(str):
        pass

    commands = [
        ("EVALSHA", "a" * 40, 2, "k1", "k2", 0, -7, 2**70, 0.1, 1e-07, 1.0 / 3, -0.0, 1e22,
         b"\x00\xff", "caf\u00e9", ""),
        ("XADD", "s", "MAXLEN", "~", 1000, "*", "f", "v"),
    ]
    assert pack(commands) == pack_python(commands)
    c_pack = connections.c_pack
    assert pack(commands) == b"".join(c_pack(command) for command in commands)
    for odd in ("k\ud800", Name("n"), bytearray(b"b"), memoryview(b"m")):
        mixed = [*commands, ("SET", "k", odd)]
        assert pack(mixed) == pack_python(mixed)
    spaced = [("PING",), ("CONFIG GET", "maxmemory")]
    assert pack(spaced) == pack_python(spaced) == pack([("PING",), ("CONFIG", "GET", "maxmemory")])


def test_every_command_of_the_package_clients_is_packed_by_pack(prefix: str) -> None:
    client = redis_client(REDIS_URL, 2.0)
    key = f"{prefix}odd\udc80key"
    client.hset(key, "field", "caf\u00e9 \ud800")
    assert client.hget(key, "field") == "caf\u00e9 \\ud800".encode()
    assert "maxmemory" in {name.decode() if isinstance(name, bytes) else name
                           for name in client.config_get("maxmemory")}


def test_pack_escapes_text_that_is_not_utf8_and_refuses_what_redis_cannot_hold() -> None:
    assert pack([("SET", "k\ud800", "v")]) == b"*3\r\n$3\r\nSET\r\n$7\r\nk\\ud800\r\n$1\r\nv\r\n"
    with pytest.raises(DataError):
        pack([("SET", "k", True)])
    with pytest.raises(DataError):
        pack([("SET", "k", None)])  # type: ignore[list-item]


def test_one_round_trip_answers_in_order_and_returns_refusals(prefix: str) -> None:
    client = redis_client(REDIS_URL, 2.0)
    key = f"{prefix}odd\ud800key"
    replies = one_round_trip(client, [
        ("SET", key, "one"),
        ("INCR", key),  # a refusal: not an integer
        ("GET", key),
    ])
    assert replies[0] in (b"OK", "OK") and replies[2] == b"one"
    assert isinstance(replies[1], ResponseError)
    # The escaped key is the one the client's own commands use too.
    assert client.get(key) == b"one"
