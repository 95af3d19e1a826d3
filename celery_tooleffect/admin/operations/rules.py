"""The rules of an operator's action on one letter: whether it may be replayed
or reconciled, and why not (one sentence an operator reads), and the
letter's effect and run id as the actions take them."""

from __future__ import annotations

from ...effect import ToolEffect
from ...identity import RUN_ID_HEADER
from ...states import DeadLetterReason, JournalState
from ...store.dead_letter_record import DeadLetter


def letter_effect(letter: DeadLetter) -> ToolEffect:
    """The effect of a letter's task (an unreadable one counts as NON_IDEMPOTENT_WRITE)."""
    try:
        return ToolEffect.coerce(letter.effect)
    except (ValueError, TypeError):
        return ToolEffect.NON_IDEMPOTENT_WRITE


def letter_label(letter: DeadLetter) -> str:
    """``name[task id]``, as every message about a letter names it."""
    return f"{letter.name or '<no task name>'}[{letter.task_id}]"


#: How a refusal names what overrides it: the CLI's options, or the page's form.
_OVERRIDE = {
    False: {"reason": "a reason (--reason)", "force": "with --force and a --reason",
            "only": "Only --force with a --reason overrides this."},
    True: {"reason": "a reason", "force": "with its confirmation box ticked and a reason",
           "only": "Only a replay confirmed below, with a reason, overrides this."},
}


def replay_refusal(
    letter: DeadLetter, *, force: bool, reason: str, bulk: bool,
    journal_state: str | None = None, page: bool = False,
) -> str | None:
    """Why ``letter`` may not be replayed this way, or None when it may.

    ``journal_state`` (when known) lets a caller preview the journal's verdict;
    the replay itself checks the journal atomically. ``page``: say what
    overrides a refusal in a page's words, not the CLI's options.
    """
    words = _OVERRIDE[page]
    label = letter_label(letter)
    effect = letter_effect(letter)
    if letter.message is None:
        return (
            f"{label} cannot be replayed: it keeps no message (envelope version "
            f"{letter.version}, written by a development build); purge it once handled"
        )
    if not letter.name:
        return (
            f"{label} cannot be replayed: its message names no task that could be "
            "published (the body is kept in the dead letter); purge it once handled"
        )
    if letter.reason == DeadLetterReason.CALL_ID_CONFLICT.value:
        return (
            f"{label} cannot be replayed: its task id belongs to another call "
            f"({letter.error}); publish it again under its own id, then purge this letter"
        )
    if force and not reason.strip():
        return f"{label}: a forced replay needs {words['reason']}: it is audited with why"
    if effect is ToolEffect.NON_IDEMPOTENT_WRITE:
        if bulk:
            return (
                f"{label} is a NON_IDEMPOTENT_WRITE: it is replayed only by its task id, one "
                f"at a time, {words['force']}; never in bulk"
            )
        recorded = _recorded_outcome(letter, journal_state)
        if recorded:
            return (
                f"{label} is a NON_IDEMPOTENT_WRITE whose outcome was recorded ({recorded}): "
                "the write ran, and it is not replayed"
            )
    if letter.body_completed and not force:
        lost = ("its result could not be stored" if letter.exception_type == "ResultNotStorable"
                else "its outcome could not be recorded")
        return (
            f"the write already ran: {label} completed its body, but {lost} "
            f"({letter.exception_type or 'AuditPersistenceFailed'}). Replaying it runs the "
            f"write a second time. {words['only']}"
        )
    if effect is ToolEffect.NON_IDEMPOTENT_WRITE and not force:
        return (
            f"{label} is a NON_IDEMPOTENT_WRITE ({letter.reason}): its write may already have "
            f"happened. Replay it only {words['force']}."
        )
    return None


def _recorded_outcome(letter: DeadLetter, journal_state: str | None) -> str:
    if journal_state == JournalState.SUCCEEDED.value:
        return "journal: succeeded"
    for late in letter.late_outcomes:
        status = late.get("status") or late.get("late_phase") or "?"
        return f"late outcome: {status}"
    return ""


#: Dead-letter reasons whose write may have happened: what reconcile is for.
RECONCILABLE = frozenset({
    DeadLetterReason.INTERRUPTED_WRITE.value, DeadLetterReason.REVOKED.value,
    DeadLetterReason.STORE_ROLLED_BACK.value,
})


def reconcile_refusal(letter: DeadLetter, *, declared: bool) -> str | None:
    """Why ``letter`` cannot be reconciled, or None when it can."""
    label = letter_label(letter)
    if not declared:
        return (f"{label}: its tool declares no reconcile (or is not registered in this "
                "app): nothing can tell whether its write happened")
    outcome_lost = letter.exception_type == "AuditPersistenceFailed"
    if letter.reason not in RECONCILABLE and not outcome_lost:
        return (f"{label} is a dead letter {letter.reason}: its write did not start or its "
                "outcome is known; there is nothing to reconcile")
    return None


def journal_refusal(letter: DeadLetter, state: str, detail: str) -> str:
    """Why the journal refused a replay of ``letter``, found in ``state`` (``detail``:
    a late outcome's status)."""
    label = letter_label(letter)
    if state == "late_outcome":
        return (f"{label} is a NON_IDEMPOTENT_WRITE whose outcome was recorded (late outcome: "
                f"{detail or '?'}): the write ran, and it is not replayed")
    if state == JournalState.SUCCEEDED.value:
        return (f"{label} is a NON_IDEMPOTENT_WRITE whose outcome was recorded (journal: "
                "succeeded): the write ran, and it is not replayed")
    if state == JournalState.RUNNING.value:
        return f"{label}: an attempt of it is running now (journal: running); not replayed"
    return f"{label}: its journal is in state {state!r}, not a dead letter's; not replayed"


def letter_run_id(letter: DeadLetter) -> str:
    """The run a letter's task belongs to (its own task id when it names none)."""
    return str(letter.run_id or letter.headers_as_delivered.get(RUN_ID_HEADER) or letter.task_id)
