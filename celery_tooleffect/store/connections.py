"""Redis clients for the store and the dead letters, one set per process, and
the one-write-many-replies call the hot path uses.

A client (and its connection pool) is never shared across a fork: the cache is
keyed by process id, so a prefork child builds its own on first use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import DataError, ResponseError
from redis.retry import Retry


class _Packer:
    """redis-py's command-packer interface over :func:`pack`, for every connection
    of the package's clients.

    With hiredis installed redis-py packs with hiredis, which refuses text that
    is not valid UTF-8 whatever ``encoding_errors`` says; its own packer
    escapes, but encodes argument by argument in Python. One packer for all
    the package's commands, the hot path's and the others' alike.
    """

    def pack(self, *args: Any) -> list[bytes]:
        return [pack([args])]


_PACKER = _Packer()


class _PackingConnection(redis.Connection):
    """A connection that packs with :func:`pack` (for cluster nodes, which take a
    connection class rather than a packer)."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return _PACKER


_lock = threading.Lock()
_clients: dict[tuple[int, str, float, bool], redis.Redis] = {}


def redis_client(url: str, socket_timeout: float, cluster: bool = False) -> redis.Redis:
    """A process-local client for ``url`` that fails fast when Redis is away.

    Timeouts are short and there are no automatic retries: the package decides
    itself what a failed store call means (retry, fail closed, dead letter).

    With ``cluster`` (the setting ``tooleffect_redis_cluster``) it is a
    :class:`redis.cluster.RedisCluster` that discovers the cluster from the
    node in ``url`` (``redis://`` or ``rediss://``, database 0). It offers the
    commands the store uses with the same signatures; it still follows
    ``MOVED``/``ASK`` redirections, but retries nothing else. Every script
    touches the keys of one run only, which share a hash slot.
    """
    key = (os.getpid(), url, socket_timeout, cluster)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                options: dict[str, Any] = {
                    "socket_timeout": socket_timeout,
                    "socket_connect_timeout": min(socket_timeout, 2.0),
                    "retry": Retry(NoBackoff(), 0),
                    "decode_responses": False,
                    # Text that is not valid UTF-8 (a lone surrogate from a JSON
                    # message) is stored escaped, never refused by the encoder.
                    "encoding_errors": "backslashreplace",
                }
                if cluster:
                    if url.startswith("redis://"):  # rediss:// picks its own class
                        options["connection_class"] = _PackingConnection
                    client = cast(redis.Redis, RedisCluster.from_url(url, **options))
                else:
                    client = redis.Redis.from_url(
                        url, health_check_interval=30, retry_on_timeout=False,
                        command_packer=_PACKER, **options,
                    )
                _clients[key] = client
    return client


def server_identity(connection_kwargs: Any) -> tuple[Any, ...]:
    """Which server, database and user a redis-py connection's keyword
    arguments reach: two clients with the same identity may share a script.

    The user counts too: a restricted ACL user may not touch every key."""
    kwargs = connection_kwargs
    return (kwargs.get("path") or kwargs.get("host") or "127.0.0.1",
            int(kwargs.get("port") or 6379) if not kwargs.get("path") else 0,
            int(kwargs.get("db") or 0), kwargs.get("username") or "default",
            kwargs.get("password") or "")


def url_identity(url: str) -> tuple[Any, ...] | None:
    """:func:`server_identity` of a ``redis://``, ``rediss://`` or ``unix://``
    URL; None for any other URL (a sentinel, another transport)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    try:
        return server_identity(redis.ConnectionPool.from_url(url).connection_kwargs)
    except (ValueError, TypeError):
        return None


#: One Redis command as it goes on the wire: its name, then its arguments.
Command = tuple[str | bytes | bytearray | memoryview | int | float, ...]


def one_round_trip(client: redis.Redis, commands: Sequence[Command]) -> list[Any]:
    """Send ``commands`` in one write and read their replies: one round trip.

    The replies come back in order, unparsed (no response callbacks); an error
    reply is returned as its ``ResponseError``, never raised, so that one
    command's refusal does not hide the others' answers. A connection error or
    timeout raises (``redis.ConnectionError`` / ``redis.TimeoutError``) and
    drops the connection: the commands may or may not have run.

    This is what a non-transactional pipeline does, without building one: on
    the hot path of every tool call that machinery costs more CPU than the
    round trip itself. On a Redis Cluster client it is a cluster pipeline.
    No commands, no round trip.
    """
    if not commands:
        return []
    if isinstance(client, RedisCluster):
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))
    pool = client.connection_pool
    # redis-py's connection methods are not annotated.
    connection: Any = pool.get_connection()
    try:
        connection.send_packed_command([pack(commands)])
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(connection.read_response())
            except ResponseError as refused:
                replies.append(refused)
        return replies
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


def pack(commands: Sequence[Command]) -> bytes:
    """``commands`` in the Redis protocol (RESP), as one buffer.

    Text that is not valid UTF-8 is escaped (``backslashreplace``). Written
    here because both packers redis-py offers are wrong for the package: its
    own encodes argument by argument in Python (a write call's ~150 arguments
    cost more CPU than its round trip), and hiredis's refuses text that is not
    valid UTF-8. As redis-py does, a command name with a space
    (``"CONFIG GET"``) is sent as two words.
    """
    parts: list[bytes] = []
    for command in commands:
        name = command[0]
        if (isinstance(name, str) and " " in name) or (isinstance(name, bytes) and b" " in name):
            command = (*name.split(), *command[1:])
        parts.append(b"*%d\r\n" % len(command))
        for argument in command:
            if isinstance(argument, str):
                encoded = argument.encode("utf-8", "backslashreplace")
            elif isinstance(argument, bytes):
                encoded = argument
            elif isinstance(argument, (bytearray, memoryview)):
                encoded = bytes(argument)
            elif isinstance(argument, (int, float)) and not isinstance(argument, bool):
                encoded = repr(argument).encode()
            else:
                raise DataError(f"cannot send {type(argument).__name__} to Redis")
            parts.append(b"$%d\r\n%s\r\n" % (len(encoded), encoded))
    return b"".join(parts)
