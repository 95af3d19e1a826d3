"""The write journal: where each attempt of a write stands, kept in Redis.

The journal is the single arbiter for writes. Every transition is one atomic
Lua script (``scripts/*.lua``) that also appends the matching audit event to
the run's events, so a transition and its audit record are stored together or
not at all.

Its states and allowed moves are :mod:`celery_tooleffect.store.states`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import redis

from ..effect import ToolEffect
from ..errors import IntentNotDurable, StoreUnavailable
from ..events import AuditEvent
from ..settings import Settings
from ..states import JournalState
from .audit import AuditLog, StoredResult, flatten, text
from .connections import one_round_trip
from .durability import Durability
from .keys import Keys
from .leases import BrokerAck, BrokerLease
from .lua import databases_argument, script
from .rollback import INTENTS
from .states import Ending, Verdict, allowed_argument

logger = logging.getLogger(__name__)

#: Errors after which a script may have run on the server with its answer lost
#: (a cut connection, a timeout): an ambiguous outcome, not a refusal.
AMBIGUOUS = (redis.ConnectionError, redis.TimeoutError)


@dataclass(frozen=True)
class Begin:
    """The answer of :meth:`Journal.begin_attempt`."""

    verdict: Verdict
    attempt: int
    detail: str
    #: For STARTED: the intent event, whose copy to the global stream is left
    #: to travel with the attempt's outcome (see ``Journal.transition``).
    intent_event: AuditEvent | None = None
    #: For STARTED: the attempt's fencing token (strictly increasing per task).
    fencing_token: int | None = None
    #: For EXHAUSTED: how the earlier attempts ended.
    endings: Mapping[Ending, int] | None = None
    #: The effect the delivery is handled under: the one it declared, or the
    #: stricter one the entry recorded (a release that declares less).
    effect: str = ""
    #: For CONFLICT: the tool the task id belongs to.
    recorded_tool: str = ""
    #: For DONE: the result an interactive call kept (a tool called in a
    #: tool's body), encoded, and its content type ('' when none was kept).
    kept_result: bytes = b""
    kept_content_type: str = ""
    #: This call found the store rolled back (:mod:`.rollback`): it holds less
    #: than it acknowledged to this process.
    rolled_back: bool = False

    @property
    def owner_lease_end(self) -> float:
        """For OWNED: when the live owner's lease ends (unix seconds)."""
        return float(self.detail or 0)


@dataclass(frozen=True)
class Transition:
    """The answer of :meth:`Journal.transition`; true when the entry moved."""

    moved: bool
    #: The state the entry was in when the script ran (a JournalState value,
    #: or 'unknown' when the answer was lost and the move found applied).
    previous_state: str

    def __bool__(self) -> bool:
        return self.moved


@dataclass(frozen=True)
class JournalRef:
    """Which entry: a task of a run."""

    run_id: str
    task_id: str


class Journal:
    """Transitions of write attempts, each one atomic with its audit event."""

    def __init__(self, settings: Settings, audit: AuditLog) -> None:
        self.settings = settings
        self.audit = audit
        self.keys = Keys(settings.key_prefix)
        #: What every journal write waits for (None: nothing; see durability.py).
        self.durability = Durability.of(settings)

    @property
    def client(self) -> redis.Redis:
        return self.audit.client

    @cached_property
    def _store_identity(self) -> tuple[Any, ...]:
        return self.settings.store_endpoint.identity()

    @cached_property
    def _store_db(self) -> int:
        return self.settings.store_endpoint.db

    def _keys(self, ref: JournalRef) -> list[str]:
        return [
            self.keys.journal(ref.run_id, ref.task_id),
            self.keys.run_events(ref.run_id),
        ]

    def begin_attempt(
        self,
        ref: JournalRef,
        *,
        token: str,
        effect: str,
        lease_end: float,
        attempts_allowed: int,
        event: AuditEvent,
        tool: str = "",
        call_digest: str = "",
        resume_interrupted: bool = False,
        broker_lease: BrokerLease | None = None,
        broker_lease_end: float = 0.0,
        sent_at: float | None = None,
        first_delivery: bool = False,
    ) -> Begin:
        """Record the intent of an attempt, or say why this delivery must not run.

        The first intent binds the task id to ``tool`` and ``call_digest``
        (:func:`celery_tooleffect.identity.call_digest`); a later delivery of
        the id under another tool or with other arguments is a CONFLICT that
        changes nothing.

        Raises :class:`StoreUnavailable` when the journal cannot be read or
        written: the body must not run then. For STARTED the intent's copy to
        the global stream is not sent here: pass ``Begin.intent_event`` as
        ``earlier_copy`` to the transition that records the outcome (or to
        ``AuditLog.copy_to_global``), so a write costs one round trip less.
        ``resume_interrupted``: the tool reconciled an interrupted attempt and
        found its write not applied, so a NON_IDEMPOTENT_WRITE may start again.
        ``broker_lease`` (the broker is on this Redis server, in this database
        or another, without a cluster): secured until ``broker_lease_end`` in
        the same script, before the intent; the
        verdict is LEASE_BUSY or LEASE_LOST, with nothing recorded, when it
        cannot be.

        The same script watches the store for a rollback (:mod:`.rollback`;
        not on a cluster): ``Begin.rolled_back`` says this call found one, and
        a NON_IDEMPOTENT_WRITE with no entry published (``sent_at``, unix
        seconds; None: unknown) before the last one found is INTERRUPTED,
        detail ``store_rolled_back`` (never a ``first_delivery``: a message its
        broker never delivered before cannot have run).
        """
        keys = self._keys(ref)
        lease_args: list[str | int] = ["", ""]
        if broker_lease is not None:
            keys += [broker_lease.mutex_key, broker_lease.index_key]
            lease_args = [broker_lease.tag, f"{broker_lease.score_for(broker_lease_end):.6f}"]
        writer = "" if self.settings.redis_cluster else self.keys.writer(INTENTS.name)
        # The count is the store's: two stores under one prefix count apart.
        counted = f"{self._store_identity}{writer}"
        if writer:
            keys += [writer, self.keys.rollback]
        args: list[str | int] = [
            token,
            f"{time.time():.6f}",
            f"{lease_end:.6f}",
            effect,
            attempts_allowed,
            self.settings.journal_ttl,
            self.settings.run_stream_maxlen,
            "1" if resume_interrupted else "0",
            *lease_args,
            tool,
            call_digest,
            INTENTS.seen(counted) if writer else "",
            "first" if first_delivery else "" if sent_at is None else f"{sent_at:.6f}",
            databases_argument(self._store_db, None,
                               broker_lease.db if broker_lease is not None else None),
            *self.audit.sealed(event),
        ]
        begin = script("begin_attempt")
        # The package's own packing, one write and one read (redis-py's command
        # path costs more CPU than the round trip); WAIT rides along.
        waits = [self.durability.command] if self.durability is not None else []
        try:
            try:
                replies = begin.call_then(self.client, keys, args, waits)
            except AMBIGUOUS:
                # The script may have run and only its answer been lost. Sent
                # again under the same token it answers 'started' for the
                # intent it recorded, instead of the next delivery finding an
                # intent nobody owns (a non-idempotent write would then be
                # dead-lettered without ever having run).
                replies = begin.call_then(self.client, keys, args, waits)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc
        answer = replies[0]
        verdict = Verdict(text(answer[0]))
        attempt, detail, handled_as, count, rolled_back = answer[1:6]
        if count:
            INTENTS.acknowledged(counted, int(count))
        if rolled_back == b"1":
            logger.warning(
                "celery-tooleffect: the store (%s) holds fewer intents than it acknowledged to "
                "this process: it was rolled back (restarted from an older file, or failed "
                "over to a replica that missed writes). Non-idempotent writes published "
                "before now that find no journal entry are reconciled or dead-lettered "
                "store_rolled_back, never run blind; see docs/redis.md#rollbacks",
                self.settings.store_endpoint.describe())
        if self.durability is not None and verdict is Verdict.STARTED:
            short = self.durability.shortfall(replies[1])
            if short is not None:
                raise IntentNotDurable(f"intent not durable: {short}", int(attempt))
        extra = answer[6:]
        if verdict is Verdict.STARTED:
            fence = int(extra[0])
            # Saves a round trip on the hot path: the copy rides with the outcome.
            return Begin(verdict, int(attempt), text(detail), effect=text(handled_as),
                         rolled_back=rolled_back == b"1", fencing_token=fence,
                         intent_event=event.amended(fencing_token=fence,
                                                    effect=text(handled_as)))
        result = Begin(verdict, int(attempt), text(detail), effect=text(handled_as),
                       rolled_back=rolled_back == b"1")
        if verdict is Verdict.EXHAUSTED:
            return replace(result, endings={
                ending: int(count) for ending, count in zip(Ending, extra, strict=True)})
        if verdict is Verdict.CONFLICT:
            return replace(result, recorded_tool=text(extra[0]))
        if verdict in (Verdict.DONE, Verdict.DEAD_LETTERED):
            # As begin_attempt.lua stored it: a duplicate, not an intent.
            self.audit.copy_to_global(event.amended(
                phase="duplicate_ignored",
                status="succeeded" if verdict is Verdict.DONE else "dead_lettered"))
        if verdict is Verdict.DONE and extra and extra[0]:
            return replace(result, kept_result=bytes(extra[0]), kept_content_type=text(extra[1]))
        return result

    def transition(
        self,
        ref: JournalRef,
        *,
        new_state: JournalState,
        allowed: frozenset[JournalState],
        event: AuditEvent,
        token: str = "",
        fields: Mapping[str, str] | None = None,
        record_late: bool = True,
        earlier_copy: AuditEvent | None = None,
        ending: Ending | None = None,
        result: StoredResult | None = None,
        ack: BrokerAck | None = None,
    ) -> Transition:
        """Move the entry to ``new_state`` and store ``event``, atomically.

        The answer is true when moved. It is false when the entry is owned by
        another attempt or is in a state not in ``allowed``: the event is then
        stored as a ``late_outcome`` (unless ``record_late`` is false).
        Raises :class:`StoreUnavailable` when nothing could be stored.
        ``earlier_copy`` is an event stored before (the attempt's intent)
        whose global-stream copy goes first in the same round trip.
        ``ending`` counts, when the entry moves, how the attempt ended.
        ``result`` (the result backend is this Redis): stored and published in
        the same script when the entry moves, so that a task's outcome and its
        Celery result are recorded together or not at all.
        """
        journal_fields = flatten(fields or {})
        now = f"{time.time():.6f}"

        event_fields = self.audit.sealed(event)
        # In the same round trip; the outcome's copy is skipped when a refusal
        # would store nothing.
        copies = []
        if earlier_copy is not None:
            copies.append(self.audit.global_copy(flatten(earlier_copy)))
        if record_late:
            copies.append(self.audit.global_copy(event_fields))

        # The outcome waits for its replicas before the message is acknowledged.
        waits = [self.durability.command] if self.durability is not None else []
        try:
            replies = script("transition").call_then(
                self.client,
                [*self._keys(ref), *([result.key] if result is not None else []),
                 *((ack.unacked_key, ack.index_key) if ack is not None else ())],
                [
                    token,
                    allowed_argument(allowed),
                    new_state.value,
                    self.settings.journal_ttl,
                    self.settings.run_stream_maxlen,
                    now,
                    "1" if record_late else "0",
                    ending.counter if ending is not None else "",
                    len(journal_fields) // 2,
                    (result.expires or 0) if result is not None else 0,
                    result.value if result is not None else "",
                    ack.tag if ack is not None else "",
                    databases_argument(self._store_db,
                                       result.db if result is not None else None,
                                       ack.db if ack is not None else None),
                    *journal_fields,
                    *event_fields,
                ],
                waits, copies,
            )
            answer = replies[0]
        except AMBIGUOUS as exc:
            # The answer was lost: the script may have run. It did if the entry
            # is in the new state with this call's exact ``updated_at``.
            if not self._applied(ref, new_state, now):
                raise StoreUnavailable(f"journal unavailable: {exc}") from exc
            answer = [b"ok", b"unknown"]
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc
        moved = answer[0] == b"ok"
        if moved and waits and len(replies) > 1:
            short = self.durability.shortfall(replies[1]) if self.durability else None
            if short is not None:
                # Recorded on the primary; a failover now may lose it. The call
                # still ends as recorded: its intent was durable, so a redelivery
                # that finds no outcome dead-letters a non-idempotent write
                # (never runs it twice) and runs an idempotent one again.
                logger.warning("journal %s of task %s (run %s) is not durable: %s",
                               new_state.value, ref.task_id, ref.run_id, short)
        if moved and not record_late:
            self.audit.copy_to_global(event)
        return Transition(moved, text(answer[1]))

    def _applied(self, ref: JournalRef, new_state: JournalState, updated_at: str) -> bool:
        """Whether the transition stamped ``updated_at`` is the entry's state now."""
        try:
            state, stamp = self.client.hmget(
                self.keys.journal(ref.run_id, ref.task_id), ["state", "updated_at"]
            )
        except redis.RedisError:
            return False
        return bool(state == new_state.value.encode() and stamp == updated_at.encode())

    def renew_lease(self, ref: JournalRef, *, token: str, lease_end: float) -> bool:
        """Push the lease of a running attempt to ``lease_end`` (never back).

        False when the attempt is no longer ``token``'s: its lease was lost.
        Raises :class:`StoreUnavailable` when the journal did not answer.
        """
        try:
            renewed = script("renew_lease")(
                self.client,
                [self.keys.journal(ref.run_id, ref.task_id)],
                [token, f"{lease_end:.6f}"],
            )
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc
        return bool(renewed)

    def recorded_effect(self, ref: JournalRef) -> ToolEffect | None:
        """The effect the entry records (None: no entry, or none recorded).
        Raises :class:`StoreUnavailable` when the journal cannot be read."""
        try:
            recorded = self.client.hget(self.keys.journal(ref.run_id, ref.task_id), "effect")
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc
        if not recorded:
            return None
        try:
            return ToolEffect.coerce(text(recorded))
        except ValueError:
            return ToolEffect.NON_IDEMPOTENT_WRITE  # unknown: the strictest

    def release(self, refs: Sequence[JournalRef]) -> None:
        """Let the entries of purged dead letters expire with the retention again
        (a ``dead_lettered`` entry has no TTL while its letter exists), in one
        round trip. Raises :class:`StoreUnavailable`."""
        if not refs:
            return
        pipe = self.client.pipeline(transaction=False)
        for ref in refs:
            pipe.expire(self.keys.journal(ref.run_id, ref.task_id), self.settings.journal_ttl)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc

    def read(self, ref: JournalRef) -> dict[str, str]:
        """The entry's fields (empty when there is none)."""
        try:
            raw = self.client.hgetall(self.keys.journal(ref.run_id, ref.task_id))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc
        return {text(key): text(value) for key, value in raw.items()}

    def replay(
        self,
        ref: JournalRef,
        *,
        token: str,
        effect: str,
        allowed: frozenset[JournalState],
        event: AuditEvent,
        refuse_late_outcome: bool,
        lapsed_running_ok: bool = False,
    ) -> Replay:
        """Reset the entry for a replay under ``token`` and store ``event``, atomically.

        The entry moves to ``replayed`` with attempt 0 (the replayed task has
        its whole attempt budget again) only from a state in ``allowed`` (or,
        with ``lapsed_running_ok``, from ``running`` whose lease has lapsed),
        and, with ``refuse_late_outcome``, only when the run's events hold no
        ``late_outcome`` of the task. Raises :class:`StoreUnavailable` when
        nothing could be stored.
        """
        request = ReplayRequest(ref, token, effect, allowed, event, refuse_late_outcome,
                                lapsed_running_ok)
        try:
            answer = script("replay")(self.client, *self._replay_call(request))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc
        moved = text(answer[0]) == "ok"
        if moved:
            self.audit.copy_to_global(event)
        return Replay(moved, text(answer[1]), text(answer[2]))

    def replay_many(self, requests: Sequence[ReplayRequest]) -> list[Replay | StoreUnavailable]:
        """:meth:`replay` for many entries: their scripts in one round trip (each
        stays atomic), then the global-stream copies of those reset in another.
        A run refused by the server is its :class:`StoreUnavailable`; raises
        :class:`StoreUnavailable` when the round trip failed."""
        try:
            answers = script("replay").call_many(
                self.client, [self._replay_call(request) for request in requests])
        except redis.RedisError as exc:
            raise StoreUnavailable(f"journal unavailable: {exc}") from exc
        replays: list[Replay | StoreUnavailable] = []
        copies = []
        for request, answer in zip(requests, answers, strict=True):
            if isinstance(answer, Exception):
                replays.append(StoreUnavailable(f"journal refused the replay: {answer}"))
                continue
            replay = Replay(text(answer[0]) == "ok", text(answer[1]), text(answer[2]))
            if replay:
                copies.append(self.audit.global_copy(flatten(request.event)))
            replays.append(replay)
        with contextlib.suppress(redis.RedisError):
            one_round_trip(self.client, copies)
        return replays

    def _replay_call(self, request: ReplayRequest) -> tuple[list[str], list[str | int]]:
        ref = request.ref
        return self._keys(ref), [
            request.token,
            f"{time.time():.6f}",
            allowed_argument(request.allowed),
            request.effect,
            self.settings.journal_ttl,
            self.settings.run_stream_maxlen,
            ref.task_id,
            "1" if request.refuse_late_outcome else "0",
            "1" if request.lapsed_running_ok else "0",
            *self.audit.sealed(request.event),
        ]


@dataclass(frozen=True)
class ReplayRequest:
    """The arguments of one :meth:`Journal.replay`, for :meth:`Journal.replay_many`."""

    ref: JournalRef
    token: str
    effect: str
    allowed: frozenset[JournalState]
    event: AuditEvent
    refuse_late_outcome: bool
    lapsed_running_ok: bool = False


@dataclass(frozen=True)
class Replay:
    """The answer of :meth:`Journal.replay`; true when the entry was reset."""

    reset: bool
    #: The state the entry was in ('absent', or 'late_outcome' when a late
    #: outcome of the task refused the replay).
    previous_state: str
    #: Attempts spent before the replay, or the late outcome's status.
    detail: str

    def __bool__(self) -> bool:
        return self.reset

