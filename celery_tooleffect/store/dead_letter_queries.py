"""What is asked of the dead letters, and what comes back: plain values, no Redis.

A :class:`DeadLetterQuery` names which letters (by queue and by the
:data:`FACETS` a letter is indexed by); a :class:`Cursor` says where a page
ended; a :class:`DeadLetterPage`, :class:`DeadLetterStats`,
:class:`DeadLetterCount` and :class:`QueueBacklog` are what the store
(:class:`~celery_tooleffect.store.dead_letters.DeadLetters`) answers, and
:func:`backlog_warnings` says which backlogs an operator should hear about.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..settings import Settings
from .dead_letter_record import DeadLetter

#: What a dead letter is indexed and counted by, besides its queue.
FACETS = ("reason", "failure_class", "effect")


def facets_of(letter: DeadLetter) -> list[tuple[str, str]]:
    """``(facet, value)`` of each of ``letter``'s :data:`FACETS`."""
    return [(facet, str(getattr(letter, facet) or "")) for facet in FACETS]


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
    #: The joint counts (:meth:`~celery_tooleffect.store.dead_letters.DeadLetters.counts`):
    #: one entry per queue, reason, failure class and effect with at least one letter.
    by_combination: list[DeadLetterCount] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
