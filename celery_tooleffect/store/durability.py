"""How durable a journal write must be before the package relies on it.

Redis replicates asynchronously: a primary that dies right after recording a
write's intent can be replaced (by Sentinel) by a replica that never saw it,
and the redelivered write would run again. With ``tooleffect_store_replicas =
N`` the intent's script is followed, on the same connection and in the same
round trip, by ``WAIT N timeout``; with ``tooleffect_store_fsync`` by
``WAITAOF 1 N timeout`` (Redis 7.2 and later: fsynced on the primary and on N
replicas). A reply that falls short means the body must not run.

What this does not promise (Redis documents it for ``WAIT``): the write is not
made strongly consistent. A failover can still promote a replica that did not
acknowledge it (when more replicas exist than were waited for, or when
Sentinel's choice is not the one that acknowledged), and a write that WAIT
timed out on is still on the primary, and may or may not reach the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import Settings
from .connections import Command


@dataclass(frozen=True)
class Durability:
    """The durability one app's journal writes wait for."""

    replicas: int
    fsync: bool
    timeout_ms: int

    @classmethod
    def of(cls, settings: Settings) -> Durability | None:
        """The app's durability; None when nothing is waited for (the default
        on a store that is not behind Sentinel)."""
        if not (settings.store_replicas or settings.store_fsync):
            return None
        return cls(settings.store_replicas, settings.store_fsync,
                   max(1, int(settings.store_wait_timeout * 1000)))

    @property
    def command(self) -> Command:
        """The command that waits, sent right after the write on its connection."""
        if self.fsync:
            return ("WAITAOF", 1, self.replicas, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)

    def shortfall(self, reply: Any) -> str | None:
        """What ``reply`` (to :attr:`command`) lacks; None when it is enough."""
        if isinstance(reply, Exception):
            return f"{'WAITAOF' if self.fsync else 'WAIT'} refused: {reply}"
        if self.fsync:
            local, replicas = (int(part) for part in reply)
            if local < 1 or replicas < self.replicas:
                return (f"fsynced locally {local}/1 and on {replicas}/{self.replicas} "
                        f"replicas within {self.timeout_ms} ms")
            return None
        if int(reply) < self.replicas:
            return f"held by {int(reply)}/{self.replicas} replicas within {self.timeout_ms} ms"
        return None

    def describe(self) -> str:
        what = f"{self.replicas} replica(s)"
        return f"{what} and fsync (WAITAOF)" if self.fsync else f"{what} (WAIT)"
