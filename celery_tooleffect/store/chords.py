"""What a replay of a chord member does to its chord.

When a chord member is dead-lettered, Celery marks it failed with its request
(``Request.on_failure`` for a ``Reject`` without requeue calls
``backend.mark_as_failure``), and the Redis result backend counts that failure
as the member's return (``RedisBackend.on_chord_part_return``). Celery 5.7's
backend records each member once, by task id and group index, so run again
the member's new result is ignored:

- if the other members have all returned, the chord has already ended: its
  callback failed with ``ChordError`` and its errbacks ran. Nothing a replay
  does can complete it, so such a replay is **refused**, with that reason;
- if the chord still waits for other members, the replay **reopens** it
  first: in one script the member's recorded failure is removed (its entry in
  the join set and its "recorded" mark), then the message is published. The
  member's next result counts as its first, and the callback runs once, when
  every member has returned; if the replay fails again the chord fails as it
  would have.

A chord whose result backend is not Redis, or keeps results in a list
(``result_chord_ordered = False``), cannot be checked: its members' replays
are refused. A group member that is not part of a chord needs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.backends.redis import RedisBackend

from .dead_letter_record import DeadLetter
from .lua import script

if TYPE_CHECKING:
    from celery import Celery


@dataclass(frozen=True)
class ChordMember:
    """A dead letter's place in a chord header."""

    task_id: str
    group_id: str
    group_index: int | None

    @property
    def recorded_as(self) -> str:
        """How Celery's backend records it: ``<task id>:<group index or +inf>``."""
        return f"{self.task_id}:{self.score}"

    @property
    def score(self) -> str:
        return "+inf" if self.group_index is None else str(self.group_index)


def chord_member(letter: DeadLetter, accept: Any) -> ChordMember | None:
    """The chord ``letter``'s task is a member of, or None (not in a chord, or unknown)."""
    if letter.message is None:
        return None
    headers = letter.message.headers
    group_id = headers.get("group")
    if not group_id:
        return None
    try:
        _, _, embed = letter.payload(accept)
    except Exception:
        return None  # its body cannot be read here; a worker could not run it either
    if not embed.get("chord"):
        return None
    index = headers.get("group_index")
    return ChordMember(
        task_id=letter.task_id, group_id=str(group_id),
        group_index=int(index) if isinstance(index, int) else None,
    )


def chord_refusal(app: Celery, letter: DeadLetter, member: ChordMember, *,
                  reopen: bool) -> str | None:
    """Why replaying ``letter`` cannot complete its chord, or None when it can.

    With ``reopen`` the chord is reopened (see the module docs) when it is
    still open; otherwise it is only looked at.
    """
    label = f"{letter.name}[{letter.task_id}]"
    backend = app.backend
    if not isinstance(backend, RedisBackend):
        return (f"{label} is a member of chord {member.group_id}, whose result backend is not "
                "Redis: whether a replay could still complete that chord cannot be checked, "
                "so it is not replayed. Run the chord again from its producer, then purge "
                "this letter.")
    if not getattr(backend, "_chord_zset", True):
        return (f"{label} is a member of chord {member.group_id}, whose results are kept in a "
                "list (result_chord_ordered is off): its recorded failure cannot be told "
                "apart, so it is not replayed. Run the chord again from its producer.")
    keys = [backend.get_key_for_group(member.group_id, suffix)
            for suffix in (".j", ".s", ".d", ".c")]
    state = script("chord_reopen")(
        backend.client, keys, [member.recorded_as, member.score, "reopen" if reopen else "check"]
    )
    if (state.decode() if isinstance(state, bytes) else str(state)) == "closed":
        return (f"{label} is a member of chord {member.group_id}, which has already ended: when "
                "it was dead-lettered, Celery's Redis result backend counted its failure, the "
                "other members returned, and the chord's callback failed (ChordError) and its "
                "errbacks ran. Celery records each member once, so a replay could not complete "
                "the chord and would leave it stopped. Run the chord again from its producer, "
                "then purge this letter.")
    return None
