"""Redis clients of the package, its own command packing, and the
one-write-many-replies call the hot path uses.

One client per process for each :class:`~celery_tooleffect.endpoints.RedisEndpoint`
the package reaches (store, dead letters, broker leases).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import DataError, ResponseError
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..endpoints import RedisEndpoint, resolve

#: hiredis's C packer (redis-py's optional C parser brings it), or None.
c_pack: Callable[[Any], bytes] | None
try:
    from hiredis import pack_command as c_pack
except ImportError:  # pragma: no cover - the tests run with hiredis
    c_pack = None


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


PACKER = _Packer()


class PackingConnection(redis.Connection):
    """A connection that packs with :func:`pack` (for cluster nodes, which take a
    connection class rather than a packer)."""

    def _construct_command_packer(self, packer: Any) -> Any:
        return PACKER


def redis_client(url: str, socket_timeout: float, cluster: bool = False) -> redis.Redis:
    """The process-local client of the Redis ``url`` names, in any form
    :func:`~celery_tooleffect.endpoints.resolve` accepts (a shorthand for
    ``client_for(resolve(url))``, for tools and tests)."""
    return client_for(resolve(url, setting="url", cluster=cluster), socket_timeout)


_SENTINEL: Any = Sentinel
_lock = threading.Lock()
_clients: dict[tuple[int, RedisEndpoint, float], redis.Redis] = {}


def client_for(endpoint: RedisEndpoint, socket_timeout: float) -> redis.Redis:
    """A process-local client for ``endpoint`` that fails fast when Redis is away.

    Timeouts are short and there are no automatic retries: the package decides
    itself what a failed store call means (retry, fail closed, dead letter).
    A client (and its pool) is never shared across a fork: the cache is keyed
    by process id, so a prefork child builds its own on first use.

    Behind Sentinel it is redis-py's ``Sentinel.master_for``: each new
    connection asks the Sentinels for the master, and a connection to a
    master that was demoted is dropped (redis-py's ``SentinelManagedConnection``
    turns its READONLY answer into a ``ConnectionError``), so a failover costs
    the calls in flight a ``connection`` failure, never a write on a replica.
    A cluster is a :class:`redis.cluster.RedisCluster` found from the node; it
    follows ``MOVED``/``ASK`` but retries nothing else.
    """
    key = (os.getpid(), endpoint, socket_timeout)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                client = _build(endpoint, socket_timeout)
                _clients[key] = client
    return client


def _build(endpoint: RedisEndpoint, socket_timeout: float) -> redis.Redis:
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": min(socket_timeout, 2.0),
        "retry": Retry(NoBackoff(), 0),
        # Text that is not valid UTF-8 (a lone surrogate from a JSON message)
        # is stored escaped, never refused by the encoder.
        "encoding_errors": "backslashreplace",
    }
    if endpoint.cluster:
        if endpoint.url.startswith("redis://"):  # rediss:// picks its own class
            common["connection_class"] = PackingConnection
        return cast(redis.Redis, RedisCluster.from_url(endpoint.url, **common))
    options = {**endpoint.options, **common}
    options.update(health_check_interval=30, retry_on_timeout=False, command_packer=PACKER)
    if endpoint.sentinels:
        sentinel_kwargs = {"socket_timeout": socket_timeout,
                           "socket_connect_timeout": min(socket_timeout, 2.0),
                           **dict(endpoint.sentinel_kwargs)}
        # Any: redis-py annotates Sentinel from 8.2 on, not before.
        manager: Any = _SENTINEL(list(endpoint.sentinels), sentinel_kwargs=sentinel_kwargs,
                                 min_other_sentinels=endpoint.min_other_sentinels)
        return cast(redis.Redis, manager.master_for(
            endpoint.master_name, redis_class=redis.Redis, **options))
    if options.get("path"):
        options["connection_class"] = redis.UnixDomainSocketConnection
        for tcp_only in ("socket_connect_timeout", "ssl"):
            options.pop(tcp_only, None)
    elif options.pop("ssl", False):
        options["connection_class"] = redis.SSLConnection
    return redis.Redis(connection_pool=redis.ConnectionPool(**options))


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

    With hiredis installed, its C ``pack_command`` packs what it accepts
    (exactly ``str``, ``bytes``, ``int`` and ``float``, written as ``str()``
    and ``repr()`` write them: the same bytes as :func:`pack_python`), about
    five times faster on a write's arguments; anything else (text that is not
    valid UTF-8, a ``str`` subclass, a ``bytearray``) goes through
    :func:`pack_python`.
    """
    if c_pack is not None:
        try:
            packed = []
            for command in commands:
                name = command[0]
                if type(name) is str and " " in name:
                    return pack_python(commands)
                packed.append(c_pack(command))
            return b"".join(packed)
        except (TypeError, UnicodeEncodeError):
            pass
    return pack_python(commands)


def pack_python(commands: Sequence[Command]) -> bytes:
    """:func:`pack` in Python alone (no hiredis, or what hiredis refuses)."""
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
