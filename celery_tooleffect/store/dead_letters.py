"""Dead letters: tasks that will not run again by themselves, kept for operators.

A dead letter holds the message exactly as the broker delivered it (see
:mod:`celery_tooleffect.store.envelope`), plus why it was dead-lettered. They live
in the broker's Redis when the broker is Redis (so an outage of a separate
audit store can still dead-letter), else in the store's Redis.

Per queue: a hash of envelopes by task id and a sorted set by time, so listing
is paged and reading one is O(1). The first reason stored for a task wins
(``HSETNX``): a later attempt to dead-letter the same task keeps the original.

Besides the per-queue index, every letter is listed, by time, in one index of
all queues and in one index per reason, failure class and effect. A page with
any filters walks the smallest of the matching indexes from a cursor, so no
listing, showing or counting ever reads every envelope: counts are the sizes
of those indexes (``ZCARD``), which cannot drift from what is stored because
the envelope and its index entries are written and removed by one script.

The indexes count each facet on its own; the same scripts also keep one hash
of joint counts (queue, reason, failure class and effect together), so that
"how many letters of each combination" (:meth:`DeadLetters.counts`, the
``tooleffect_dead_letters`` gauge) is one ``HGETALL``. A letter stored by a
release without that hash is in the indexes but not in the joint counts; its
removal never takes a joint count below 0.

Lifecycle: an unresolved letter is never dropped or expired (no key here has
a TTL); it is counted and aged per queue (:meth:`DeadLetters.backlog`,
:func:`backlog_warnings`). Removing a letter (replay, purge) removes every
trace of it here, its queue and facets from their sets included once their
index is empty; what it left in the store (journal, run stream) expires with
the retention.
"""

from __future__ import annotations

import builtins
import json
import shlex
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from ..errors import StoreUnavailable
from ..settings import Settings, settings_for

# DeadLetterReason is a public name (celery_tooleffect.states); imported from
# here too, as it was defined here before.
from ..states import DeadLetterReason as DeadLetterReason
from ..store.audit import text
from ..store.connections import client_for, one_round_trip
from ..store.envelope import MessageEnvelope
from ..store.keys import Keys
from ..store.lua import KeyOrArg, script

if TYPE_CHECKING:
    from celery import Celery


#: Version of the envelope this release writes and reads (see :class:`DeadLetter`).
ENVELOPE_VERSION = 2


#: Content types whose decoding runs no code of the message's choosing
#: (kombu's YAML decoder is ``yaml.safe_load``).
SAFE_CONTENT = ("json", "msgpack", "yaml")


def conflict_letter_id(task_id: str, digest: str) -> str:
    """The id a call-id conflict is dead-lettered under: not the task id, whose
    dead letter (if any) and journal are the first call's."""
    return f"{task_id}.conflict-{digest[:12]}"


@dataclass
class DeadLetter:
    """A dead-lettered task: the message as the broker delivered it, and why it is here.

    ``message`` keeps the message whole, so that a replay publishes the same
    bytes, headers and properties (see :mod:`celery_tooleffect.store.envelope`);
    whoever can read the dead-letter keys can read it. Every letter this
    release stores has one (envelope version 2). A letter of version 1, which
    only development builds wrote (no release did), kept no message: it is read
    without one (its arguments are not shown), its replay is refused, and it
    can be purged.
    """

    task_id: str
    name: str
    queue: str
    reason: str
    failure_class: str
    effect: str
    run_id: str = ""
    exception_type: str = ""
    error: str = ""
    attempts: int = 0
    worker: str = ""
    body_completed: bool = False
    dead_lettered_at: float = field(default_factory=time.time)
    #: The message as the broker delivered it (None only on its way from the
    #: pool process, which does not hold it, and in a letter of version 1).
    message: MessageEnvelope | None = None
    #: Envelope version (a stored letter without one is of version 1).
    version: int = ENVELOPE_VERSION
    #: Outcomes reported by a worker that had lost its lease after the task
    #: was dead-lettered: the write still ran, and this says how it ended.
    late_outcomes: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the stored envelope); :meth:`from_dict` reads it back equal."""
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["message"] = self.message.to_dict() if self.message is not None else None
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeadLetter:
        known = set(cls.__dataclass_fields__)
        values = {key: value for key, value in data.items() if key in known}
        values.setdefault("version", 1)  # version 1 did not say its version
        message = values.get("message")
        values["message"] = MessageEnvelope.from_dict(message) if message else None
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes) -> DeadLetter:
        return cls.from_dict(json.loads(text))

    @property
    def args(self) -> list[Any]:
        """The task's positional arguments, decoded (JSON, msgpack or YAML bodies;
        empty when the body cannot be decoded that way). Use :meth:`payload`
        with the app's ``accept_content`` for other content types."""
        return self._safe_payload()[0]

    @property
    def kwargs(self) -> dict[str, Any]:
        """The task's keyword arguments, decoded as :attr:`args` is."""
        return self._safe_payload()[1]

    def _safe_payload(self) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
        try:
            return self.payload(SAFE_CONTENT)
        except Exception:
            return [], {}, {}

    @property
    def headers_as_delivered(self) -> Mapping[str, Any]:
        """The message's headers (none without a message)."""
        return self.message.headers if self.message is not None else {}

    def payload(self, accept: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
        """``(args, kwargs, embed)`` of the task, decoded for display only.

        ``accept``: the app's ``accept_content``. Raises what kombu raises when
        the body cannot (or may not) be decoded. ``embed`` holds the canvas
        fields of a protocol 2 body (``callbacks``, ``errbacks``, ``chain``,
        ``chord``).
        """
        if self.message is None:
            raise ValueError(f"{self.task_id}: no message kept (envelope version {self.version})")
        return self.message.task_payload(accept)


class DeadLetters:
    """Stores and reads dead letters."""

    def __init__(self, app: Celery, settings: Settings | None = None) -> None:
        self.settings = settings or settings_for(app)
        self.keys = Keys(self.settings.key_prefix)

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

    # -- indexes, paging, counts and removal -------------------------------------

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
        keys = self._query_keys(query)
        client = self.client
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.zcard(key)
        sizes = [int(size) for size in pipe.execute()]
        ordered = [key for _, key in sorted(zip(sizes, keys, strict=True))]
        primary, others = ordered[0], ordered[1:]
        total = min(sizes) if not others else None
        if min(sizes) == 0:
            return DeadLetterPage([], None, 0 if total is not None else None)

        wanted = limit + 1  # one more than asked: tells whether a next page exists
        chunk = wanted if not others else max(4 * wanted, 200)
        found: builtins.list[tuple[bytes, float]] = []
        cursor = before
        while len(found) < wanted:
            entries, exhausted = _older(client, primary, cursor, chunk)
            if not entries:
                break
            cursor = Cursor(entries[-1][1], text(entries[-1][0]))
            if others:
                members = [member for member, _ in entries]
                pipe = client.pipeline(transaction=False)
                for key in others:
                    pipe.zmscore(key, members)  # type: ignore[arg-type]
                present = pipe.execute()
                entries = [
                    entry for i, entry in enumerate(entries)
                    if all(scores[i] is not None for scores in present)
                ]
            found.extend(entries)
            if exhausted:
                break
            if others:  # rare matches: read further ahead each time
                chunk = min(chunk * 2, 5000)
        more = len(found) > limit
        found = found[:limit]
        letters = self._read_envelopes([text(member) for member, _ in found], query.queue)
        next_cursor = Cursor(found[-1][1], text(found[-1][0])) if more and found else None
        return DeadLetterPage(letters, next_cursor, total)

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
            return _counts(self.client.hgetall(self.keys.dead_letter_counts))
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
            pipe = self.client.pipeline(transaction=False)
            for queue in queues:
                pipe.zrevrange(self.keys.dead_letter_index(queue), -1, -1, withscores=True)
            replies = pipe.execute() if queues else []
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc
        return {
            queue: entries[0][1]
            for queue, reply in zip(queues, replies, strict=True)
            if (entries := _entries(reply))
        }

    def backlog(self) -> dict[str, QueueBacklog]:
        """How many unresolved dead letters each queue holds and when its oldest
        was stored, for the queues that hold one.

        Two round trips whatever the number of letters: the set of queues,
        then ``ZCARD`` and the lowest score of each queue's index, pipelined.
        Raises :class:`StoreUnavailable`.
        """
        try:
            queues = self.queues()
            pipe = self.client.pipeline(transaction=False)
            for queue in queues:
                index = self.keys.dead_letter_index(queue)
                pipe.zcard(index)
                pipe.zrevrange(index, -1, -1, withscores=True)
            replies = pipe.execute() if queues else []
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letters unavailable: {exc}") from exc
        found: dict[str, QueueBacklog] = {}
        for i, queue in enumerate(queues):
            count, oldest = int(replies[2 * i]), _entries(replies[2 * i + 1])
            if count and oldest:
                found[queue] = QueueBacklog(queue, count, oldest[0][1])
        return found

    def stats(self) -> DeadLetterStats:
        """How many dead letters there are, by queue, reason, failure class and effect,
        and of each combination of the four (:meth:`counts`).

        Three round trips whatever the number of dead letters: the counts are
        the sizes of the indexes, and the joint counts one ``HGETALL``.
        """
        client = self.client
        pipe = client.pipeline(transaction=False)
        pipe.smembers(self.keys.dead_letter_queues)
        pipe.smembers(self.keys.dead_letter_facets)
        queue_members, facet_members = pipe.execute()
        queues = sorted(text(member) for member in queue_members)
        facets = sorted(
            tuple(text(member).split(":", 1)) for member in facet_members
            if ":" in text(member)
        )
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(self.keys.dead_letter_counts)
        pipe.zcard(self.keys.dead_letter_all)
        pipe.hlen(self.keys.dead_letter_replaying)
        for queue in queues:
            pipe.zcard(self.keys.dead_letter_index(queue))
        for facet, value in facets:
            pipe.zcard(self.keys.dead_letter_facet(facet, value))
        joint, *sizes = pipe.execute()
        total, replaying, *counts = (int(count) for count in sizes)
        by: dict[str, dict[str, int]] = {facet: {} for facet in FACETS}
        by_queue = {
            queue: count for queue, count in zip(queues, counts[: len(queues)], strict=True)
            if count
        }
        for (facet, value), count in zip(facets, counts[len(queues):], strict=True):
            if count and facet in by:
                by[facet][value] = count
        return DeadLetterStats(
            total=total,
            by_queue=by_queue,
            by_reason=by["reason"],
            by_failure_class=by["failure_class"],
            by_effect=by["effect"],
            replay_pending=replaying,
            by_combination=_counts(joint),
        )

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

    def _query_keys(self, query: DeadLetterQuery) -> builtins.list[str]:
        keys: builtins.list[str] = []
        if query.queue:
            keys.append(self.keys.dead_letter_index(query.queue))
        for facet, value in query.facets():
            keys.append(self.keys.dead_letter_facet(facet, value))
        return keys or [self.keys.dead_letter_all]

    def _read_envelopes(
        self, task_ids: builtins.list[str], queue: str | None
    ) -> builtins.list[DeadLetter]:
        if not task_ids:
            return []
        client = self.client
        if queue is not None:
            queues: builtins.list[Any] = [queue] * len(task_ids)
        else:
            queues = list(client.hmget(self.keys.dead_letter_locations, task_ids))
        pipe = client.pipeline(transaction=False)
        located = [
            (task_id, text(where)) for task_id, where in zip(task_ids, queues, strict=True)
            if where is not None
        ]
        for task_id, where in located:
            pipe.hget(self.keys.dead_letters(where), task_id)
        return [DeadLetter.from_json(raw) for raw in pipe.execute() if raw is not None]


#: What a dead letter is indexed and counted by, besides its queue.
FACETS = ("reason", "failure_class", "effect")


def facets_of(letter: DeadLetter) -> list[tuple[str, str]]:
    """``(facet, value)`` of each of ``letter``'s :data:`FACETS`."""
    return [(facet, str(getattr(letter, facet) or "")) for facet in FACETS]


def combination_field(letter: DeadLetter) -> str:
    """``letter``'s field in the joint counts: a JSON array of its queue, reason,
    failure class and effect (unambiguous whatever characters they hold)."""
    values = [letter.queue, *(value for _, value in facets_of(letter))]
    return json.dumps(values, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class HeldLetter:
    """A dead letter as :meth:`DeadLetters.get_many` read it: the letter, its
    stored bytes (a take succeeds only while they are unchanged) and its queue."""

    letter: DeadLetter
    raw: bytes
    queue: str


@dataclass(frozen=True)
class QueueBacklog:
    """The unresolved dead letters of one queue: how many, and when the oldest
    of them was stored (unix seconds)."""

    queue: str
    count: int
    oldest_at: float


def backlog_warnings(backlog: Mapping[str, QueueBacklog], settings: Settings,
                     now: float) -> list[str]:
    """What to warn about in ``backlog``: one line per queue holding more dead
    letters than ``tooleffect_dead_letter_warn_count``, or one stored longer
    ago than ``tooleffect_dead_letter_warn_age`` seconds; sorted by queue."""
    warnings = []
    for queue in sorted(backlog):
        entry = backlog[queue]
        age = max(now - entry.oldest_at, 0.0)
        over = []
        if entry.count > settings.dead_letter_warn_count:
            over.append(f"more than tooleffect_dead_letter_warn_count "
                        f"({settings.dead_letter_warn_count})")
        if age > settings.dead_letter_warn_age:
            over.append(f"older than tooleffect_dead_letter_warn_age "
                        f"({settings.dead_letter_warn_age:g}s)")
        if over:
            warnings.append(
                f"queue {queue!r} holds {entry.count} unresolved dead letter(s), the oldest "
                f"stored {_duration(age)} ago: {' and '.join(over)}; replay or purge them "
                f"(celery tooleffect dlq list -Q {shlex.quote(queue)})")
    return warnings


def _duration(seconds: float) -> str:
    """``seconds`` in the largest whole unit: 45s, 12m, 5h, 3d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


@dataclass(frozen=True)
class DeadLetterCount:
    """How many dead letters have this queue, reason, failure class and effect."""

    queue: str
    reason: str
    failure_class: str
    effect: str
    count: int


def _counts(reply: Mapping[Any, Any]) -> list[DeadLetterCount]:
    """The joint counts hash as :class:`DeadLetterCount`, sorted; fields that are not
    four strings, or counts not above 0, are left out."""
    found: list[DeadLetterCount] = []
    for raw_field, raw_count in reply.items():
        try:
            values = json.loads(raw_field)
            count = int(raw_count)
        except ValueError:
            continue
        if (count > 0 and isinstance(values, list) and len(values) == 4
                and all(isinstance(value, str) for value in values)):
            queue, reason, failure_class, effect = values
            found.append(DeadLetterCount(queue, reason, failure_class, effect, count))
    return sorted(found, key=lambda row: (row.queue, row.reason, row.failure_class, row.effect))


@dataclass(frozen=True)
class DeadLetterQuery:
    """Which dead letters: every filter that is set must match (None: any)."""

    queue: str | None = None
    reason: str | None = None
    failure_class: str | None = None
    effect: str | None = None

    def facets(self) -> list[tuple[str, str]]:
        return [(facet, value) for facet in FACETS if (value := getattr(self, facet))]


@dataclass(frozen=True)
class Cursor:
    """Where a page ended: the next page holds what was stored before it.

    Its text form ``<time>:<task id>`` is what the CLI and the JSON API hand
    out as ``next_cursor``.
    """

    stored_at: float
    task_id: str

    def encode(self) -> str:
        return f"{self.stored_at!r}:{self.task_id}"

    @classmethod
    def decode(cls, value: str) -> Cursor:
        stored_at, sep, task_id = value.partition(":")
        if not sep:
            raise ValueError(f"not a cursor: {value!r}")
        return cls(float(stored_at), task_id)


@dataclass(frozen=True)
class DeadLetterPage:
    """One page of dead letters, newest first."""

    letters: list[DeadLetter]
    #: Where the next page starts; None on the last page.
    next_cursor: Cursor | None
    #: How many dead letters match in all (None when not known without a walk).
    total: int | None


@dataclass(frozen=True)
class DeadLetterStats:
    """Dead-letter counts; only values with at least one dead letter are listed."""

    total: int
    by_queue: dict[str, int]
    by_reason: dict[str, int]
    by_failure_class: dict[str, int]
    by_effect: dict[str, int]
    #: Letters taken aside by a replay that has not finished.
    replay_pending: int = 0
    #: The joint counts (:meth:`DeadLetters.counts`): one entry per queue, reason,
    #: failure class and effect with at least one letter.
    by_combination: list[DeadLetterCount] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _older(
    client: redis.Redis, key: str, cursor: Cursor | None, count: int
) -> tuple[list[tuple[bytes, float]], bool]:
    """Up to ``count`` entries of ``key``, newest first, strictly older than ``cursor``,
    and whether the index ran out.

    Entries with the cursor's own time are ordered by task id (as Redis
    orders equal scores), so a cursor is exact even when times tie.
    """
    if cursor is None:
        entries = _entries(client.zrevrange(key, 0, count - 1, withscores=True))
        return entries, len(entries) < count
    mark = cursor.task_id.encode()
    skip = 0
    while True:
        batch = _entries(client.zrevrangebyscore(
            key, repr(cursor.stored_at), "-inf", start=skip, num=count, withscores=True
        ))
        kept = [
            (member, score) for member, score in batch
            if not (score == cursor.stored_at and member >= mark)
        ]
        if kept or len(batch) < count:
            return kept, len(batch) < count
        skip += count


def _entries(reply: Any) -> list[tuple[bytes, float]]:
    """A sorted-set reply with scores, as ``(member, score)`` pairs."""
    return [(bytes(member), float(score)) for member, score in reply]
