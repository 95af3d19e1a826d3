"""The effects live workers declare: one hash in the store, one field per worker.

During a rolling upgrade two releases of a tool may declare different effects
(release 1 READ_ONLY, release 2 NON_IDEMPOTENT_WRITE). The journal settles
each call under the strictest effect it recorded (``begin_attempt.lua``); this
hash lets workers and operators *see* such a disagreement:

- key :attr:`~celery_tooleffect.store.keys.Keys.declared_effects`
  (``<prefix>workers:effects``), a hash;
- field: a worker's node name (``celery@host``, Celery's ``-n``): one entry
  per worker, replaced as a whole by each refresh;
- value: JSON ``{"release": "2", "tools": {"t.changing":
  "non_idempotent_write", ...}, "pid": 4242, "seen_at": 1700000000.0,
  "expires_at": 1700000090.0}``.

A worker writes its entry at start and refreshes it while it lives; an entry
whose ``expires_at`` has passed is a dead worker's and is ignored by readers
and deleted by the next writer. A worker that stops cleanly deletes its own.
The key's TTL is pushed out by every write, so it vanishes when every worker
is gone. Times are the writers' clocks (as the journal's leases are): the
entries' lifetime is a few refresh intervals, far above any sane skew.

Redis only: nothing here knows Celery's worker (see
:mod:`celery_tooleffect.worker.startup` for who writes).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from ..effect import ToolEffect
from ..errors import StoreUnavailable
from ..settings import Settings
from .audit import text
from .connections import client_for
from .keys import Keys


@dataclass(frozen=True)
class WorkerDeclaration:
    """What one worker declares: its release and the effect of each of its tools."""

    worker: str
    release: str
    #: Tool name to effect value.
    tools: Mapping[str, str]
    pid: int = 0
    #: When the entry was written, and when it lapses unless written again.
    seen_at: float = 0.0
    expires_at: float = 0.0

    def live(self, now: float | None = None) -> bool:
        """Whether the entry has not lapsed at ``now`` (default: this clock's now)."""
        return self.expires_at > (time.time() if now is None else now)

    def encode(self) -> str:
        return json.dumps({
            "release": self.release, "tools": dict(self.tools), "pid": self.pid,
            "seen_at": self.seen_at, "expires_at": self.expires_at,
        }, sort_keys=True)

    @classmethod
    def decode(cls, worker: str, value: str) -> WorkerDeclaration | None:
        """The entry of ``worker``; None when ``value`` is not one (written by
        something else: such a field counts as lapsed and is deleted)."""
        try:
            data = json.loads(value)
            tools = {str(name): str(effect) for name, effect in data["tools"].items()}
            return cls(worker=worker, release=str(data.get("release") or ""), tools=tools,
                       pid=int(data.get("pid") or 0), seen_at=float(data.get("seen_at") or 0),
                       expires_at=float(data["expires_at"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def label(self) -> str:
        """``worker (release R)``, or ``worker (no release)``."""
        return f"{self.worker} ({f'release {self.release}' if self.release else 'no release'})"


@dataclass(frozen=True)
class Declarer:
    """One worker that declares a tool with a given effect."""

    worker: str
    release: str
    effect: str


@dataclass(frozen=True)
class ToolDeclarations:
    """Every live declaration of one tool."""

    name: str
    declarers: tuple[Declarer, ...] = field(default_factory=tuple)

    @property
    def effects(self) -> list[str]:
        """The distinct effects declared, strictest first."""
        return sorted({d.effect for d in self.declarers},
                      key=lambda value: (-ToolEffect.strictest(value).strictness, value))

    @property
    def conflict(self) -> bool:
        """Whether live workers disagree about the tool's effect."""
        return len(self.effects) > 1

    @property
    def strictest(self) -> str:
        """The strictest declared effect: what a call is handled under once the
        journal recorded it (a value that is no effect counts as
        NON_IDEMPOTENT_WRITE)."""
        return ToolEffect.strictest(*self.effects).value


def by_tool(declarations: Iterable[WorkerDeclaration]) -> list[ToolDeclarations]:
    """The declarations regrouped per tool, sorted by tool name (declarers by worker)."""
    tools: dict[str, list[Declarer]] = {}
    for declaration in declarations:
        for name, effect in declaration.tools.items():
            tools.setdefault(name, []).append(
                Declarer(declaration.worker, declaration.release, effect))
    return [ToolDeclarations(name, tuple(sorted(declarers, key=lambda d: d.worker)))
            for name, declarers in sorted(tools.items())]


@dataclass(frozen=True)
class Disagreement:
    """Another live worker declares one of this worker's tools differently."""

    tool: str
    effect: str
    other: WorkerDeclaration
    other_effect: str


def disagreements(own: WorkerDeclaration,
                  others: Iterable[WorkerDeclaration]) -> list[Disagreement]:
    """Each tool of ``own`` that another worker in ``others`` declares with
    another effect (``own`` itself, by node name, is skipped)."""
    found = []
    for other in others:
        if other.worker == own.worker:
            continue
        for name, effect in sorted(own.tools.items()):
            theirs = other.tools.get(name)
            if theirs is not None and theirs != effect:
                found.append(Disagreement(name, effect, other, theirs))
    return found


class EffectDeclarations:
    """The hash of declared effects in the store's Redis."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)

    @property
    def client(self) -> redis.Redis:
        return client_for(self.settings.store_endpoint, self.settings.socket_timeout)

    def publish(self, worker: str, *, release: str, tools: Mapping[str, str], ttl: float,
                pid: int = 0, now: float | None = None) -> list[WorkerDeclaration]:
        """Write ``worker``'s entry, lapsing ``ttl`` seconds from ``now``, and
        return every live entry (this one included), sorted by worker, read in
        the same round trip.

        Lapsed entries found are deleted (one more round trip, only then).
        Raises :class:`StoreUnavailable` when the store did not answer.
        """
        moment = time.time() if now is None else now
        own = WorkerDeclaration(worker=worker, release=release, tools=dict(tools), pid=pid,
                                seen_at=moment, expires_at=moment + ttl)
        key = self.keys.declared_effects
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(key, worker, own.encode())
            # The key outlives its newest entry a little, then goes with the
            # last worker.
            pipe.expire(key, max(int(ttl * 2), 1))
            pipe.hgetall(key)
            raw = pipe.execute()[-1]
        except redis.RedisError as exc:
            raise StoreUnavailable(f"declared effects unavailable: {exc}") from exc
        return self._live_or_prune(raw, moment)

    def withdraw(self, worker: str) -> None:
        """Delete ``worker``'s entry (a worker that stops). Raises
        :class:`StoreUnavailable` when the store did not answer."""
        try:
            self.client.hdel(self.keys.declared_effects, worker)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"declared effects unavailable: {exc}") from exc

    def live(self, now: float | None = None) -> list[WorkerDeclaration]:
        """Every live entry, sorted by worker (one HGETALL; lapsed ones are
        left for a worker to delete: readers never write). Raises
        :class:`StoreUnavailable` when the store did not answer."""
        moment = time.time() if now is None else now
        try:
            raw = self.client.hgetall(self.keys.declared_effects)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"declared effects unavailable: {exc}") from exc
        return sorted((entry for entry in self._decoded(raw)
                       if entry is not None and entry.live(moment)),
                      key=lambda entry: entry.worker)

    def _live_or_prune(self, raw: Mapping[Any, Any], now: float) -> list[WorkerDeclaration]:
        decoded = self._decoded(raw)
        lapsed = [text(worker) for worker, entry in zip(raw, decoded, strict=True)
                  if entry is None or not entry.live(now)]
        if lapsed:
            # Best effort: the next writer tries again.
            with contextlib.suppress(redis.RedisError):
                self.client.hdel(self.keys.declared_effects, *lapsed)
        return sorted((entry for entry in decoded if entry is not None and entry.live(now)),
                      key=lambda entry: entry.worker)

    @staticmethod
    def _decoded(raw: Mapping[Any, Any]) -> Sequence[WorkerDeclaration | None]:
        """Each field of ``raw`` decoded, in ``raw``'s order."""
        return [WorkerDeclaration.decode(text(worker), text(value))
                for worker, value in raw.items()]
