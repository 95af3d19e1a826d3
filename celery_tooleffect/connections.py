"""Redis clients for the store and the dead letters, one set per process.

A client (and its connection pool) is never shared across a fork: the cache is
keyed by process id, so a prefork child builds its own on first use.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

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
                    client = cast(redis.Redis, RedisCluster.from_url(url, **options))
                else:
                    client = redis.Redis.from_url(
                        url, health_check_interval=30, retry_on_timeout=False, **options
                    )
                _clients[key] = client
    return client
