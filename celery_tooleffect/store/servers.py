"""The Redis servers behind an app's store and dead letters, and what they say of
themselves (``INFO``): which server plays which role, how many replicas are
in sync. Used at worker start, by a running worker's watches, by the CLI
and by Flower's ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster

#: The two roles a Redis server plays (the ``store`` label of the gauges).
JOURNAL, DEAD_LETTERS = "journal", "dead_letters"
ROLES = {JOURNAL: "the journal and audit store", DEAD_LETTERS: "the dead-letter store"}


@dataclass
class Server:
    """One Redis server and the roles it plays."""

    address: str
    client: Any
    roles: list[str] = field(default_factory=list)

    @property
    def role(self) -> str:
        return " and ".join(ROLES[role] for role in self.roles)


def address_of(client: Any) -> str:
    """``host:port`` (or the socket path, or the Sentinel service) ``client`` reaches."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None) or {}
    if kwargs.get("path"):
        return str(kwargs["path"])
    service = getattr(pool, "service_name", None)
    if service:
        return f"sentinel master {service}"
    if kwargs.get("host"):
        return f"{kwargs['host']}:{kwargs.get('port') or 6379}"
    return f"redis client {id(client):#x}"


def servers_of(store: Any, dead_letters: Any | None) -> list[Server]:
    """The distinct servers of the store's client and the dead letters' client
    (each once; a cluster's every primary)."""
    found: dict[str, Server] = {}
    for role, client in ((JOURNAL, store), (DEAD_LETTERS, dead_letters)):
        if client is None:
            continue
        if isinstance(client, RedisCluster):
            clients = [(node.name, client.get_redis_connection(node))
                       for node in client.get_primaries()]  # type: ignore[no-untyped-call]
        else:
            clients = [(address_of(client), client)]
        for address, node in clients:
            server = found.setdefault(address, Server(address, node))
            if role not in server.roles:
                server.roles.append(role)
    return list(found.values())


def online_replicas(client: redis.Redis) -> int:
    """Replicas of the server that are in sync (``INFO replication``: a replica
    still loading its first copy is connected, but acknowledges nothing)."""
    info: dict[str, Any] = dict(client.info("replication"))
    return sum(1 for name, value in info.items() if name.startswith("slave")
               and isinstance(value, dict) and value.get("state") == "online")
