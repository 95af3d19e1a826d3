"""What operators filter listings by, taken from the enums: one place for the
CLI's ``click.Choice`` options and Flower's filter forms and query parameters.

A value outside these is refused where it comes in: by click (usage error,
exit code 2) on the command line, with 400 by Flower (:func:`dead_letter_query`
and :func:`approval_state` raise ``ValueError``, naming the choices).
"""

from __future__ import annotations

import re

from ..effect import ToolEffect
from ..failures import FailureClass
from ..states import ApprovalState, DeadLetterReason
from ..store.dead_letter_queries import DeadLetterQuery

#: ``--dead-letter-reason`` / ``dead_letter_reason``: why a message became a dead letter.
DEAD_LETTER_REASONS = DeadLetterReason.values()
#: ``--failure-class`` / ``failure_class``.
FAILURE_CLASSES = FailureClass.values()
#: ``--effect`` / ``effect``.
EFFECTS = ToolEffect.values()
#: ``approvals list --state``: the states a listed call has (never ``absent``, no
#: record, nor ``ended``, off the list).
LISTED_APPROVAL_STATES = tuple(
    state.value for state in ApprovalState
    if state not in (ApprovalState.ABSENT, ApprovalState.ENDED)
)


def dead_letter_query(queue: str | None = None, dead_letter_reason: str | None = None,
                      failure_class: str | None = None,
                      effect: str | None = None) -> DeadLetterQuery:
    """The dead letters matching every filter given (empty or None: any); a value
    that is not one of the enum's is a ``ValueError``."""
    return DeadLetterQuery(
        queue=queue or None,
        reason=DeadLetterReason.coerce(dead_letter_reason).value if dead_letter_reason else None,
        failure_class=FailureClass.coerce(failure_class).value if failure_class else None,
        effect=ToolEffect.coerce(effect).value if effect else None,
    )


def approval_state(value: str | None) -> ApprovalState | None:
    """The approval state a listing is filtered by (empty or None: any); a value that
    is not an approval state is a ``ValueError``."""
    return ApprovalState.coerce(value) if value else None


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: str) -> float:
    """An age filter (``dlq purge --all --older-than``, a bulk purge's
    ``older_than``): ``90``, ``90s``, ``15m``, ``2h``, ``7d`` or ``1w`` as
    seconds; ``ValueError`` naming the forms otherwise."""
    match = _DURATION.match(value)
    if not match:
        raise ValueError(f"not a duration: {value!r} (use e.g. 90s, 15m, 2h, 7d, 1w)")
    return float(match.group(1)) * _UNITS[match.group(2)]
