"""Dead letters: tasks that will not run again by themselves, kept for operators.

A dead letter holds the full envelope needed to publish the task again, plus
why it was dead-lettered. They live in the broker's Redis when the broker is
Redis (so an outage of a separate audit store can still dead-letter), else in
the store's Redis.

Per queue: a hash of envelopes by task id and a sorted set by time, so listing
is paged and reading one is O(1). The first reason stored for a task wins
(``HSETNX``): a later attempt to dead-letter the same task keeps the original.
"""

from __future__ import annotations

import enum
import heapq
import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from .audit import text
from .connections import redis_client
from .errors import StoreUnavailable
from .keys import Keys
from .settings import Settings, settings_for

if TYPE_CHECKING:
    from celery import Celery


class DeadLetterReason(str, enum.Enum):
    """Why a task was dead-lettered."""

    NOT_RETRYABLE = "not_retryable"
    RETRIES_EXHAUSTED = "retries_exhausted"
    INTERRUPTED_WRITE = "interrupted_write"
    UNKNOWN_TASK = "unknown_task"
    UNDECODABLE_MESSAGE = "undecodable_message"
    MALFORMED_MESSAGE = "malformed_message"

    def __str__(self) -> str:
        return self.value


@dataclass
class DeadLetter:
    """The envelope of a dead-lettered task and why it is here.

    ``args``, ``kwargs`` and ``headers`` are kept verbatim because a replay
    needs them; whoever can read the dead-letter keys can read them.
    """

    task_id: str
    name: str
    queue: str
    reason: str
    failure_class: str
    effect: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""
    exception_type: str = ""
    error: str = ""
    attempts: int = 0
    worker: str = ""
    body_completed: bool = False
    dead_lettered_at: float = field(default_factory=time.time)
    #: For a message that could not be decoded: its body as text (or base64),
    #: with the content type and encoding it claimed.
    raw_body: str | None = None
    raw_body_encoding: str | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    #: Outcomes reported by a worker that had lost its lease after the task
    #: was dead-lettered: the write still ran, and this says how it ended.
    late_outcomes: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=repr, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> DeadLetter:
        data = json.loads(text)
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in data.items() if key in known})


class DeadLetters:
    """Stores and reads dead letters."""

    def __init__(self, app: Celery, settings: Settings | None = None) -> None:
        self.app = app
        self.settings = settings or settings_for(app)
        self.keys = Keys(self.settings.key_prefix)

    @property
    def client(self) -> redis.Redis:
        return redis_client(self.settings.dead_letter_url, self.settings.socket_timeout)

    def store(self, letter: DeadLetter) -> bool:
        """Store ``letter``; True if stored now, False if the task already was one.

        Raises :class:`StoreUnavailable` when it could not be stored: the
        caller must then keep the message (requeue it or leave it unacked).
        """
        queue = letter.queue
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hsetnx(self.keys.dead_letters(queue), letter.task_id, letter.to_json())
            pipe.zadd(
                self.keys.dead_letter_index(queue),
                {letter.task_id: letter.dead_lettered_at},
                nx=True,
            )
            pipe.sadd(self.keys.dead_letter_queues, queue)
            pipe.hsetnx(self.keys.dead_letter_locations, letter.task_id, queue)
            created, *_ = pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"dead letter not stored: {exc}") from exc
        return bool(created)

    def record_late_outcome(self, task_id: str, event: dict[str, str]) -> bool:
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

    def count(self, queue: str | None = None) -> int:
        """How many dead letters ``queue`` (or every queue) holds."""
        queues = [queue] if queue is not None else self.queues()
        pipe = self.client.pipeline(transaction=False)
        for name in queues:
            pipe.zcard(self.keys.dead_letter_index(name))
        return int(sum(pipe.execute()))

    def list(
        self, queue: str | None = None, *, limit: int = 50, offset: int = 0
    ) -> list[DeadLetter]:
        """Dead letters newest first, ``limit`` of them after skipping ``offset``.

        Reads at most ``offset + limit`` index entries per queue, never a whole
        queue.
        """
        queues = [queue] if queue is not None else self.queues()
        window = offset + limit
        pipe = self.client.pipeline(transaction=False)
        for name in queues:
            pipe.zrevrange(self.keys.dead_letter_index(name), 0, window - 1, withscores=True)
        per_queue = pipe.execute()
        newest = heapq.merge(
            *[[(-score, text(task_id), name) for task_id, score in entries]
              for name, entries in zip(queues, per_queue, strict=True)]
        )
        page = [entry for _, entry in zip(range(window), newest, strict=False)][offset:]
        if not page:
            return []
        pipe = self.client.pipeline(transaction=False)
        for _, task_id, name in page:
            pipe.hget(self.keys.dead_letters(name), task_id)
        return [DeadLetter.from_json(raw) for raw in pipe.execute() if raw is not None]
