"""The dead-letter store: tasks that will not run again by themselves, kept for operators.

A dead letter (:class:`~celery_tooleffect.store.dead_letter_record.DeadLetter`)
holds the message exactly as the broker delivered it, plus why it was
dead-lettered. They live in the broker's Redis when the broker is Redis (so an
outage of a separate audit store can still dead-letter), else in the store's
Redis.

Per queue: a hash of envelopes by task id and a sorted set by time, so listing
is paged and reading one is O(1). The first reason stored for a task wins
(``HSETNX``): a later attempt to dead-letter the same task keeps the original.
One script stores a letter with its entries in every index and its joint
count, and one removes them all (replay, purge), so what is read through the
indexes (:mod:`celery_tooleffect.store.dead_letter_indexes`: paging, counts)
cannot drift from what is stored. A letter stored by a release without the
joint counts is in the indexes but not in the joint counts; its removal never
takes a joint count below 0.

Lifecycle: an unresolved letter is never dropped or expired (no key here has
a TTL); it is counted and aged per queue (:meth:`DeadLetters.backlog`,
:func:`~celery_tooleffect.store.dead_letter_queries.backlog_warnings`).
Removing a letter (replay, purge) removes every trace of it here, its queue
and facets from their sets included once their index is empty; what it left
in the store (journal, run events) expires with the retention.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from ..errors import StoreUnavailable
from ..settings import Settings, settings_for

# DeadLetterReason is a public name (celery_tooleffect.states); imported from
# here too, as it was defined here before.
from ..states import DeadLetterReason as DeadLetterReason
from .audit import text
from .connections import client_for, one_round_trip
from .dead_letter_indexes import (
    combination_field,
    counts_of,
    read_backlog,
    read_oldest,
    read_page,
    read_stats,
)
from .dead_letter_queries import (
    Cursor,
    DeadLetterCount,
    DeadLetterPage,
    DeadLetterQuery,
    DeadLetterStats,
    QueueBacklog,
    facets_of,
)
from .dead_letter_record import DeadLetter
from .keys import Keys
from .lua import KeyOrArg, script

if TYPE_CHECKING:
    from celery import Celery


def dead_letter_keys(settings: Settings) -> Keys:
    """The key names of the dead letters of ``settings``: on a Redis Cluster
    (a RabbitMQ broker with ``tooleffect_redis_cluster``) all in the one slot
    ``{dlq}``, so that each script below touches one slot; else as they
    always were (per-queue keys tagged ``{dlq:<queue>}``, indexes untagged)."""
    return Keys(settings.key_prefix,
                dead_letters_in_one_slot=settings.dead_letter_endpoint.cluster)


class DeadLetters:
    """Stores and reads dead letters."""

    def __init__(self, app: Celery, settings: Settings | None = None) -> None:
        self.settings = settings or settings_for(app)
        self.keys = dead_letter_keys(self.settings)

    @property
    def client(self) -> redis.Redis:
        return client_for(self.settings.dead_letter_endpoint, self.settings.socket_timeout)

    def store(self, letter: DeadLetter) -> bool:
        """Store ``letter``; True if stored now, False if the task already was one.

        Raises :class:`StoreUnavailable` when it could not be stored: the
        caller must then keep the message (requeue it or leave it unacked).
        """
        try:
            # One round trip: a script, so that the indexes that page and
            # count without scanning (see ``page`` and ``stats``) and the
            # joint counts change only when the envelope is stored (the first
            # one wins).
            created = script("dead_letter_store")(self.client, *self.store_arguments(letter))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letter not stored: {exc}") from exc
        return bool(created)

    def store_arguments(
        self, letter: DeadLetter
    ) -> tuple[builtins.list[str], builtins.list[str]]:
        """The KEYS and ARGV of ``dead_letter_store.lua`` that store ``letter``."""
        queue = letter.queue
        keys = self.keys
        return (
            [
                keys.dead_letters(queue),
                keys.dead_letter_index(queue),
                keys.dead_letter_queues,
                keys.dead_letter_locations,
                keys.dead_letter_facets,
                keys.dead_letter_counts,
                *self.shared_index_keys(letter),
            ],
            [
                letter.task_id,
                letter.to_json(),
                repr(float(letter.dead_lettered_at)),
                queue,
                combination_field(letter),
                *(f"{facet}:{value}" for facet, value in facets_of(letter)),
            ],
        )

    def record_late_outcome(self, task_id: str, event: Mapping[str, str]) -> bool:
        """Copy a late outcome onto the task's dead letter, if it has one.

        True when copied. Fail-soft: the outcome is in the audit log already.
        """
        queue = self.queue_of(task_id)
        if queue is None:
            return False
        key = self.keys.dead_letters(queue)

        def append(pipe: Any) -> None:
            raw = pipe.hget(key, task_id)
            if raw is None:
                return
            letter = DeadLetter.from_json(raw)
            letter.late_outcomes.append(dict(event))
            pipe.multi()
            pipe.hset(key, task_id, letter.to_json())

        try:
            self.client.transaction(append, key)
        except redis.RedisError:
            return False
        return True

    def queue_of(self, task_id: str) -> str | None:
        where = self.client.hget(self.keys.dead_letter_locations, task_id)
        return text(where) if where is not None else None

    def exists(self, task_id: str) -> bool:
        """Whether ``task_id`` is a dead letter. Raises StoreUnavailable."""
        try:
            return self.get(task_id) is not None
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc

    def get(self, task_id: str) -> DeadLetter | None:
        """The dead letter of ``task_id``, or None."""
        queue = self.queue_of(task_id)
        if queue is None:
            return None
        raw = self.client.hget(self.keys.dead_letters(queue), task_id)
        return DeadLetter.from_json(raw) if raw is not None else None

    def queues(self) -> list[str]:
        """Queues that have dead letters, sorted by name."""
        members = self.client.smembers(self.keys.dead_letter_queues)
        return sorted(text(member) for member in members)

    def list(self, queue: str | None = None, *, limit: int = 50) -> builtins.list[DeadLetter]:
        """The newest ``limit`` dead letters of ``queue`` (None: every queue), newest first.

        The first page of :meth:`page`: for the pages after it, or for
        filters, call :meth:`page` and pass its ``next_cursor`` on.
        """
        if limit < 1:
            return []
        return self.page(DeadLetterQuery(queue=queue), limit=limit).letters

    # -- paging and counts, read through the indexes (dead_letter_indexes) -------

    def shared_index_keys(self, letter: DeadLetter) -> builtins.list[str]:
        """The indexes besides its queue's that list ``letter``: all queues, and its facets."""
        return [
            self.keys.dead_letter_all,
            *(self.keys.dead_letter_facet(facet, value) for facet, value in facets_of(letter)),
        ]

    def page(
        self,
        query: DeadLetterQuery | None = None,
        *,
        limit: int = 50,
        before: Cursor | None = None,
    ) -> DeadLetterPage:
        """Up to ``limit`` dead letters matching ``query``, newest first, older than ``before``.

        Cost: a few round trips and O(log N + limit) work per index for no
        filter or one; with several filters, the smallest matching index is
        walked from the cursor and each candidate checked against the others
        (``ZMSCORE``), so the walk is bounded by the size of the smallest
        matching index, never by the number of dead letters. ``total`` is the
        exact number of matches when at most one filter is given, else None.
        """
        query = query or DeadLetterQuery()
        limit = max(int(limit), 1)
        return read_page(self.client, self.keys, query, limit, before)

    def matching_ids(
        self, query: DeadLetterQuery | None = None, *, older_than: float | None = None,
        batch: int = 500,
    ) -> Iterator[builtins.list[str]]:
        """Task ids matching ``query`` (stored before ``older_than``), in batches, newest first.

        Walks with a cursor, so removing what it yields while it runs is safe.
        """
        cursor = Cursor(older_than, "") if older_than is not None else None
        while True:
            page = self.page(query, limit=batch, before=cursor)
            if page.letters:
                yield [letter.task_id for letter in page.letters]
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def counts(self) -> builtins.list[DeadLetterCount]:
        """How many dead letters there are of each queue, reason, failure class and
        effect together (only combinations with at least one), sorted.

        One ``HGETALL`` of the joint counts, whatever the number of dead
        letters. Letters stored by a release without the joint counts are
        not in them (they are in :meth:`stats`' per-facet counts).
        """
        try:
            return counts_of(self.client.hgetall(self.keys.dead_letter_counts))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc

    def oldest(self) -> dict[str, float]:
        """When the oldest dead letter of each queue was stored (unix seconds),
        for the queues that have one.

        Two round trips: the set of queues, then one ``ZREVRANGE -1 -1
        WITHSCORES`` per queue index (its lowest score, as ``ZRANGE 0 0`` would
        read it, with a command the documented ACL already allows), pipelined.
        """
        try:
            queues = self.queues()
            return read_oldest(self.client, self.keys, queues)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc

    def backlog(self) -> dict[str, QueueBacklog]:
        """How many unresolved dead letters each queue holds and when its oldest
        was stored, for the queues that hold one.

        Two round trips whatever the number of letters: the set of queues,
        then ``ZCARD`` and the lowest score of each queue's index, pipelined.
        Raises :class:`StoreUnavailable`.
        """
        try:
            queues = self.queues()
            return read_backlog(self.client, self.keys, queues)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc

    def stats(self) -> DeadLetterStats:
        """How many dead letters there are, by queue, reason, failure class and effect,
        and of each combination of the four (:meth:`counts`).

        Three round trips whatever the number of dead letters: the counts are
        the sizes of the indexes, and the joint counts one ``HGETALL``.
        """
        return read_stats(self.client, self.keys)

    # -- taking and removing: one script each, with every index entry -----------

    def take(self, task_id: str) -> DeadLetter | None:
        """Move the dead letter of ``task_id`` aside for a replay; None if there is none.

        Atomic: of two operators replaying the same task at once, one gets the
        letter and the other None. Until :meth:`forget_taken` or
        :meth:`put_back`, the letter is in the hash of replays in progress
        (:meth:`taken`), so a replay that dies half-way loses nothing. A
        new dead letter of the same task (the replay failed again) is stored
        normally meanwhile.
        """
        return self._remove(task_id, "move")

    def remove(self, task_id: str) -> DeadLetter | None:
        """Delete the dead letter of ``task_id`` with its index entries; None if there is none."""
        return self._remove(task_id, "delete")

    def put_back(self, letter: DeadLetter) -> bool:
        """Return a letter taken by :meth:`take` to the store (its replay did not happen).

        True when stored again; False when the task meanwhile became a dead
        letter again (that newer letter stays).
        """
        created = self.store(letter)
        self.forget_taken(letter.task_id)
        return created

    def forget_taken(self, task_id: str) -> None:
        """Forget a letter taken by :meth:`take` once its replay (or purge) is done."""
        try:
            self.client.hdel(self.keys.dead_letter_replaying, task_id)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc

    def taken(self, task_id: str) -> tuple[DeadLetter, float] | None:
        """The letter of ``task_id`` taken by a replay or purge not finished, and when."""
        raw: Any = self.client.hget(self.keys.dead_letter_replaying, task_id)
        if raw is None:
            return None
        stamp, _, envelope = bytes(raw).partition(b"\n")
        try:
            taken_at = float(stamp)
        except ValueError:
            taken_at, envelope = 0.0, bytes(raw)
        return DeadLetter.from_json(envelope), taken_at

    # -- in bulk: one round trip per step for a whole batch ----------------------

    def get_many(self, task_ids: Sequence[str]) -> builtins.list[HeldLetter | None]:
        """The dead letters of ``task_ids`` as stored (None where there is none),
        in two round trips for any number. Raises :class:`StoreUnavailable`."""
        try:
            locations = one_round_trip(self.client, [
                ("HGET", self.keys.dead_letter_locations, task_id) for task_id in task_ids])
            found = [(i, text(queue)) for i, queue in enumerate(locations)
                     if isinstance(queue, bytes)]
            raws = one_round_trip(self.client, [
                ("HGET", self.keys.dead_letters(queue), task_ids[i]) for i, queue in found])
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc
        held: builtins.list[HeldLetter | None] = [None] * len(task_ids)
        for (i, queue), raw in zip(found, raws, strict=True):
            if isinstance(raw, bytes):
                held[i] = HeldLetter(DeadLetter.from_json(raw), raw, queue)
        return held

    def take_many(self, held: Sequence[HeldLetter]) -> builtins.list[bool]:
        """:meth:`take` for letters read by :meth:`get_many`, in one round trip;
        each take stays atomic. False where the letter changed or went since it
        was read (take it alone). Raises :class:`StoreUnavailable`."""
        now = repr(time.time())
        calls: builtins.list[tuple[builtins.list[KeyOrArg], builtins.list[KeyOrArg]]] = [
            ([*self._remove_keys(entry.letter, entry.queue)],
             self._remove_arguments(entry.letter, entry.raw, "move", entry.queue, now))
            for entry in held]
        try:
            answers = script("dead_letter_remove").call_many(self.client, calls)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc
        return [not isinstance(answer, Exception) and bool(answer) for answer in answers]

    def forget_taken_many(self, task_ids: Sequence[str]) -> None:
        """:meth:`forget_taken` for many letters, in one round trip."""
        if not task_ids:
            return
        try:
            self.client.hdel(self.keys.dead_letter_replaying, *task_ids)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc

    def _remove_keys(self, letter: DeadLetter, queue: str) -> builtins.list[str]:
        return [
            self.keys.dead_letters(queue),
            self.keys.dead_letter_locations,
            self.keys.dead_letter_replaying,
            self.keys.dead_letter_counts,
            self.keys.dead_letter_queues,
            self.keys.dead_letter_facets,
            self.keys.dead_letter_index(queue),
            *self.shared_index_keys(letter),
        ]

    def _remove_arguments(self, letter: DeadLetter, raw: KeyOrArg, mode: str, queue: str,
                          now: str) -> builtins.list[KeyOrArg]:
        """The ARGV of ``dead_letter_remove.lua`` for ``letter`` (read as ``raw``)."""
        return [letter.task_id, raw, mode, queue, now, combination_field(letter),
                *(f"{facet}:{value}" for facet, value in facets_of(letter))]

    def _remove(self, task_id: str, mode: str) -> DeadLetter | None:
        for _ in range(10):  # the letter changes only when a late outcome is copied onto it
            try:
                queue = self.queue_of(task_id)
                if queue is None:
                    return None
                raw = self.client.hget(self.keys.dead_letters(queue), task_id)
                if raw is None:
                    return None
                letter = DeadLetter.from_json(raw)
                taken = script("dead_letter_remove")(
                    self.client,
                    self._remove_keys(letter, queue),
                    self._remove_arguments(letter, raw, mode, queue, repr(time.time())),
                )
            except redis.RedisError as exc:
                raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc
            if taken:
                return letter
        return None


@dataclass(frozen=True)
class HeldLetter:
    """A dead letter as :meth:`DeadLetters.get_many` read it: the letter, its
    stored bytes (a take succeeds only while they are unchanged) and its queue."""

    letter: DeadLetter
    raw: bytes
    queue: str
