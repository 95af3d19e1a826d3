"""Start-up checks of where the store is and how durable its writes are.

- Behind Sentinel, the Sentinels must know a master of the configured name: a
  name they do not know is refused (a typo would otherwise fail every write).
- With ``tooleffect_store_replicas`` / ``tooleffect_store_fsync`` the store
  must accept ``WAIT`` / ``WAITAOF`` (managed Redis may refuse them, Redis
  before 7.2 has no ``WAITAOF``) and have at least that many replicas
  connected: otherwise every write would fail before its body, so the worker
  refuses to start and says why.
- Without them, a store that has replicas is warned about: a failover can
  promote a replica that never saw a write's intent, and the write would run
  again.

A store that does not answer at start is warned about, not refused: writes
fail closed until it is back.
"""

from __future__ import annotations

from typing import Any

import redis

from ..endpoints import RedisEndpoint
from ..store.connections import client_for
from ..store.durability import Durability
from ..store.runtime import ToolRuntime


def sentinel_refusal(endpoint: RedisEndpoint, role: str, socket_timeout: float) -> str | None:
    """Why ``endpoint``'s Sentinels cannot serve it (None: they can, or none answered)."""
    answered = False
    for host, port in endpoint.sentinels:
        options = {"socket_timeout": socket_timeout,
                   "socket_connect_timeout": min(socket_timeout, 2.0),
                   **dict(endpoint.sentinel_kwargs)}
        sentinel = redis.Redis(host=host, port=port, **options)
        try:
            address = sentinel.execute_command(  # type: ignore[no-untyped-call]
                "SENTINEL", "get-master-addr-by-name", endpoint.master_name)
        except redis.RedisError:
            continue
        finally:
            sentinel.close()
        if address:
            return None
        answered = True
    if answered:
        return (f"{role}: the Sentinels {_hosts(endpoint)} know no master named "
                f"{endpoint.master_name!r} (the transport option master_name)")
    return None


def durability_check(runtime: ToolRuntime) -> tuple[list[str], list[str]]:
    """(refusals, warnings) about the store's Sentinels and replicas."""
    settings = runtime.settings
    refusals: list[str] = []
    warnings: list[str] = []
    stores = {settings.store_endpoint: "the journal and audit store"}
    stores.setdefault(settings.dead_letter_endpoint, "the dead-letter store")
    for endpoint, role in stores.items():
        if endpoint.behind_sentinel:
            refusal = sentinel_refusal(endpoint, role, settings.socket_timeout)
            if refusal:
                refusals.append(refusal)
    if refusals:
        return refusals, warnings
    store = settings.store_endpoint
    durability = Durability.of(settings)
    client = client_for(store, settings.socket_timeout)
    if durability is not None:
        try:
            client.execute_command(*_probe(durability))  # type: ignore[no-untyped-call]
        except redis.ResponseError as refused:
            return [f"the journal and audit store ({store.describe()}) refuses "
                    f"{_probe(durability)[0]} ({refused}): {durability.describe()} cannot be "
                    "waited for (tooleffect_store_replicas, tooleffect_store_fsync)"], warnings
        except redis.RedisError as exc:
            return [], [f"could not check WAIT on the journal and audit store "
                        f"({store.describe()}): {exc}"]
    try:
        connected = online_replicas(client)
    except redis.RedisError as exc:  # INFO may be denied to a restricted user
        return [], [f"could not check the replicas of the journal and audit store "
                    f"({store.describe()}): {exc}"]
    if durability is not None and connected < durability.replicas:
        refusals.append(
            f"tooleffect_store_replicas is {durability.replicas} but the journal and audit "
            f"store ({store.describe()}) has {connected} replica(s) in sync: every write "
            "would fail before its body; lower it, or start the replicas first")
    elif durability is None and connected:
        warnings.append(
            f"the journal and audit store ({store.describe()}) has {connected} replica(s) "
            "and tooleffect_store_replicas is 0: a failover can promote a replica that "
            "never saw a write's intent, and that write would run again "
            "(set tooleffect_store_replicas = 1)")
    return refusals, warnings


def _probe(durability: Durability) -> tuple[str, ...]:
    """A WAIT / WAITAOF that returns at once: does the store accept it?"""
    return ("WAITAOF", "0", "0", "0") if durability.fsync else ("WAIT", "0", "0")


def online_replicas(client: redis.Redis) -> int:
    """Replicas of the server that are in sync (``INFO replication``: a replica
    still loading its first copy is connected, but acknowledges nothing)."""
    info: dict[str, Any] = dict(client.info("replication"))
    return sum(1 for name, value in info.items() if name.startswith("slave")
               and isinstance(value, dict) and value.get("state") == "online")


def _hosts(endpoint: RedisEndpoint) -> str:
    return ",".join(f"{host}:{port}" for host, port in endpoint.sentinels)
