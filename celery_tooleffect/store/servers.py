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


def policy_evicts(policy: str) -> bool:
    """Whether ``maxmemory-policy`` ``policy`` may evict a key the package keeps
    (every key of the package has a TTL, so ``volatile-*`` may too)."""
    return policy.strip().lower() != "noeviction"


@dataclass(frozen=True)
class Reading:
    """What ``INFO`` says of the servers of one role."""

    evicted_keys: int
    evicting: bool


def role_readings(found: list[Server]) -> tuple[dict[str, Reading], dict[str, Exception]]:
    """Each role's :class:`Reading` (one ``INFO`` per server; a cluster's primaries
    summed), and the roles whose servers did not answer, with why."""
    readings: dict[str, Reading] = {}
    failed: dict[str, Exception] = {}
    for server in found:
        try:
            info = server.client.info()
            reading = Reading(int(info.get("evicted_keys", 0)),
                              policy_evicts(text(info.get("maxmemory_policy", "noeviction"))))
        except Exception as exc:
            for role in server.roles:
                failed[role] = exc
            continue
        for role in server.roles:
            before = readings.get(role, Reading(0, False))
            readings[role] = Reading(before.evicted_keys + reading.evicted_keys,
                                     before.evicting or reading.evicting)
    return {role: reading for role, reading in readings.items() if role not in failed}, failed


def text(value: Any) -> str:
    """A reply's bytes or value as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
