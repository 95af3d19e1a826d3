"""What an operator's action is: who acts, the why kept, and how it ended
(:class:`ActionResult`, one per task), shared by dead letters and approvals."""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...choices import Choice

#: Environment variable naming who acts, for the audit (default: user@host).
ACTOR_ENV = "TOOLEFFECT_ACTOR"
#: Longest operator reason kept in an audit event, in characters.
REASON_LIMIT = 1000


def default_actor() -> str:
    """Who acts from this process: ``$TOOLEFFECT_ACTOR``, else ``user@host``."""
    named = os.environ.get(ACTOR_ENV, "").strip()
    if named:
        return named
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


class Outcome(Choice):
    """How one operator action on one letter ended."""

    __choice_name__ = "an action outcome"

    DONE = "done"
    REFUSED = "refused"
    NOT_FOUND = "not_found"
    FAILED = "failed"


@dataclass(frozen=True)
class ActionResult:
    """The result of replaying, purging or reconciling one task."""

    task_id: str
    action: str
    outcome: Outcome
    message: str
    name: str = ""
    effect: str = ""
    queue: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.DONE

    def to_dict(self) -> dict[str, str]:
        return {
            "task_id": self.task_id,
            "action": self.action,
            "outcome": self.outcome.value,
            "message": self.message,
            "name": self.name,
            "effect": self.effect,
            "queue": self.queue,
        }


def results_summary(results: Iterable[ActionResult]) -> dict[str, Any]:
    """The stable JSON of ``dlq replay --json`` and ``dlq purge --json``."""
    listed = [result.to_dict() for result in results]
    counts = {outcome.value: 0 for outcome in Outcome}
    for result in listed:
        counts[result["outcome"]] += 1
    return {"results": listed, **counts}
