"""Detecting a store that came back holding less than it acknowledged.

A Redis that restarts from an older file (RDB snapshots only, or an AOF that a
machine crash cut short) or fails over to a replica that missed writes comes
back *rolled back*: a write's intent that it acknowledged is gone, and the
message of that write is back in its queue (on a Redis broker the same
snapshot holds both) or still unacknowledged (RabbitMQ). Delivered again, it
finds no journal entry and would run its body a second time.

How it is detected (``docs/redis.md#rollbacks``). Every worker process counts
the intents the store acknowledged to it, and the intent script
(``begin_attempt.lua``) keeps that count in the store under a key of the
process's own (:meth:`Keys.writer`). Each intent passes the count the process
last saw acknowledged; a store that holds a smaller one (or none) has lost an
intent it acknowledged: a rollback. Only that process writes its key, so
other processes' writes cannot hide the loss (a single shared counter could
be caught up by them before the process looks again).

The script that detects it records the time in one key
(:meth:`Keys.rollback`), and from then on every intent script reads it: a
NON_IDEMPOTENT_WRITE whose journal has no entry, and whose message was
published before the detection (the ``tooleffect_sent_at`` header that
:class:`~celery_tooleffect.ToolTask` producers stamp; a message without one
counts as older), may be one whose first run the rollback erased. It is not run
blind: its journal records it interrupted (``store_rolled_back``), its tool's
``reconcile`` is asked, and without a ``reconcile`` (or when it answers
unknown) it is a dead letter ``store_rolled_back``. IDEMPOTENT_WRITE and
READ_ONLY tools run again, as after any interruption.

What it cannot detect: a rollback that lost no intent of a process that
writes again afterwards (another process's lost intent is then caught only
when that process writes again; until then the marker is not set); a
rollback that every worker process lived through without writing, or that
came with a restart of every worker (their counts are kept in memory only:
a new process starts from nothing); a store rolled back to before the
process's first intent. A Redis Cluster store is not watched (the count and
the mark are keys of no run's hash slot).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading

#: The header a ToolTask producer stamps on each message it publishes: the
#: time it was published (unix seconds). Informational: it only decides
#: whether a message is older than a detected rollback.
SENT_AT_HEADER = "tooleffect_sent_at"


class IntentCounter:
    """This process's name, and the count of intents each store acknowledged to it.

    One per process: a forked pool child starts its own counts (its parent's
    are not the child's), under a name of its own. Counts are kept per store
    and writer key, so that apps with other stores or prefixes in one process
    do not mix.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._name = ""
        self._seen: dict[str, int] = {}

    def _here(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._name = f"{socket.gethostname()}:{self._pid}:{secrets.token_hex(4)}"
            self._seen = {}

    @property
    def name(self) -> str:
        """This process's name in the writer keys."""
        with self._lock:
            self._here()
            return self._name

    def seen(self, key: str) -> int:
        """The count last acknowledged under ``key`` (a store and its writer key)."""
        with self._lock:
            self._here()
            return self._seen.get(key, 0)

    def acknowledged(self, key: str, count: int) -> None:
        """The store acknowledged ``count`` under ``key`` (a store and its writer key)."""
        with self._lock:
            self._here()
            if count > self._seen.get(key, 0):
                self._seen[key] = count


#: The process's counts.
INTENTS = IntentCounter()
