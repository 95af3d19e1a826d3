"""Reading the dead letters through their indexes: pages and counts, never a scan.

Every letter is listed, by time, in its queue's index, in one index of all
queues and in one index per reason, failure class and effect (see
:data:`~celery_tooleffect.store.dead_letter_queries.FACETS`). A page with any
filters walks the smallest of the matching indexes from a cursor
(:func:`read_page`), so no listing, showing or counting ever reads every
envelope: counts are the sizes of those indexes (``ZCARD``), which cannot
drift from what is stored because the envelope and its index entries are
written and removed by one script
(:class:`~celery_tooleffect.store.dead_letters.DeadLetters`).

The indexes count each facet on its own; the same scripts also keep one hash
of joint counts, one field per combination of queue, reason, failure class
and effect (:func:`combination_field`), so that "how many letters of each
combination" is one ``HGETALL`` (:func:`counts_of` reads it).

These functions let :class:`redis.RedisError` out: the store's methods say
what it means.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis

from .audit import text
from .dead_letter_queries import (
    FACETS,
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


def combination_field(letter: DeadLetter) -> str:
    """``letter``'s field in the joint counts: a JSON array of its queue, reason,
    failure class and effect (unambiguous whatever characters they hold)."""
    values = [letter.queue, *(value for _, value in facets_of(letter))]
    return json.dumps(values, ensure_ascii=False, separators=(",", ":"))


def counts_of(reply: Mapping[Any, Any]) -> list[DeadLetterCount]:
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


def query_keys(keys: Keys, query: DeadLetterQuery) -> list[str]:
    """The indexes that list what ``query`` matches (all queues' when it has no filter)."""
    found: list[str] = []
    if query.queue:
        found.append(keys.dead_letter_index(query.queue))
    for facet, value in query.facets():
        found.append(keys.dead_letter_facet(facet, value))
    return found or [keys.dead_letter_all]


def read_page(
    client: redis.Redis, keys: Keys, query: DeadLetterQuery, limit: int, before: Cursor | None
) -> DeadLetterPage:
    """Up to ``limit`` dead letters matching ``query``, newest first, older than
    ``before`` (see :meth:`~celery_tooleffect.store.dead_letters.DeadLetters.page`
    for the cost)."""
    index_keys = query_keys(keys, query)
    pipe = client.pipeline(transaction=False)
    for key in index_keys:
        pipe.zcard(key)
    sizes = [int(size) for size in pipe.execute()]
    ordered = [key for _, key in sorted(zip(sizes, index_keys, strict=True))]
    primary, others = ordered[0], ordered[1:]
    total = min(sizes) if not others else None
    if min(sizes) == 0:
        return DeadLetterPage([], None, 0 if total is not None else None)

    wanted = limit + 1  # one more than asked: tells whether a next page exists
    chunk = wanted if not others else max(4 * wanted, 200)
    found: list[tuple[bytes, float]] = []
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
    letters = read_envelopes(client, keys, [text(member) for member, _ in found], query.queue)
    next_cursor = Cursor(found[-1][1], text(found[-1][0])) if more and found else None
    return DeadLetterPage(letters, next_cursor, total)


def read_envelopes(
    client: redis.Redis, keys: Keys, task_ids: list[str], queue: str | None
) -> list[DeadLetter]:
    """The letters of ``task_ids`` (all of ``queue``, or each where the
    locations hash says), in order; those gone meanwhile are left out."""
    if not task_ids:
        return []
    if queue is not None:
        queues: list[Any] = [queue] * len(task_ids)
    else:
        queues = list(client.hmget(keys.dead_letter_locations, task_ids))
    pipe = client.pipeline(transaction=False)
    located = [
        (task_id, text(where)) for task_id, where in zip(task_ids, queues, strict=True)
        if where is not None
    ]
    for task_id, where in located:
        pipe.hget(keys.dead_letters(where), task_id)
    return [DeadLetter.from_json(raw) for raw in pipe.execute() if raw is not None]


def read_oldest(client: redis.Redis, keys: Keys, queues: list[str]) -> dict[str, float]:
    """When the oldest dead letter of each of ``queues`` was stored, for those
    that have one: one ``ZREVRANGE -1 -1 WITHSCORES`` per queue index, pipelined."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.zrevrange(keys.dead_letter_index(queue), -1, -1, withscores=True)
    replies = pipe.execute() if queues else []
    return {
        queue: entries[0][1]
        for queue, reply in zip(queues, replies, strict=True)
        if (entries := _entries(reply))
    }


def read_backlog(client: redis.Redis, keys: Keys, queues: list[str]) -> dict[str, QueueBacklog]:
    """The backlog of each of ``queues`` that holds a letter: ``ZCARD`` and the
    lowest score of each queue's index, pipelined."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        index = keys.dead_letter_index(queue)
        pipe.zcard(index)
        pipe.zrevrange(index, -1, -1, withscores=True)
    replies = pipe.execute() if queues else []
    found: dict[str, QueueBacklog] = {}
    for i, queue in enumerate(queues):
        count, oldest = int(replies[2 * i]), _entries(replies[2 * i + 1])
        if count and oldest:
            found[queue] = QueueBacklog(queue, count, oldest[0][1])
    return found


def read_stats(client: redis.Redis, keys: Keys) -> DeadLetterStats:
    """The counts by queue and by facet (index sizes) and the joint counts, in
    three round trips whatever the number of dead letters."""
    pipe = client.pipeline(transaction=False)
    pipe.smembers(keys.dead_letter_queues)
    pipe.smembers(keys.dead_letter_facets)
    queue_members, facet_members = pipe.execute()
    queues = sorted(text(member) for member in queue_members)
    facets = sorted(
        tuple(text(member).split(":", 1)) for member in facet_members
        if ":" in text(member)
    )
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.dead_letter_counts)
    pipe.zcard(keys.dead_letter_all)
    pipe.hlen(keys.dead_letter_replaying)
    for queue in queues:
        pipe.zcard(keys.dead_letter_index(queue))
    for facet, value in facets:
        pipe.zcard(keys.dead_letter_facet(facet, value))
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
        by_combination=counts_of(joint),
    )


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
