"""The states and reasons a user of the package compares against, in one place,
as Celery's ``celery/states.py`` names a task's states.

- :class:`JournalState`: where a write's journal entry stands
  (:meth:`Journal.read <celery_tooleffect.store.journal.Journal.read>`,
  ``celery tooleffect dlq show``);
- :class:`ApprovalState`: where a call that needs a person's approval stands
  (:class:`~celery_tooleffect.store.approvals.Approval`, ``Approvals``);
- :class:`Approver`: who approves a tool's calls (its ``requires_approval``);
- :class:`DeadLetterReason`: why a task is a dead letter
  (:class:`~celery_tooleffect.store.dead_letter_record.DeadLetter`, the
  ``dead_letter_reason`` of a ``task-failed`` event);
- :class:`CallStatus`: where a call stands as an agent is told
  (:class:`~celery_tooleffect.agents.CallReport`, the MCP server's results
  and its ``tooleffect_call_status`` tool).

Each is a string enum: a member equals its value (``JournalState.SUCCEEDED ==
"succeeded"``), which is what Redis, the CLI's ``--json`` and the events hold,
and ``coerce`` reads a value back. How an entry or an approval may move from
one state to another, and the diagrams, are
:mod:`celery_tooleffect.store.states`.

Two other vocabularies stay beside what they describe:
:class:`~celery_tooleffect.failures.FailureClass` (why a call failed) with its
classifier, and :class:`~celery_tooleffect.reconciliation.ReconcileStatus` with
:class:`~celery_tooleffect.reconciliation.Reconciliation`, the answer it is
the status of.
"""

from __future__ import annotations

from typing import Any

from .choices import Choice

__all__ = ["ApprovalState", "Approver", "CallStatus", "DeadLetterReason", "JournalState"]


class JournalState(Choice):
    """Where a write's journal entry stands."""

    __choice_name__ = "a journal state"

    #: No entry (never written, expired, or lost with the store).
    ABSENT = "absent"
    #: An attempt owns the entry (under its owner token and lease) and may be
    #: running the body.
    RUNNING = "running"
    #: The write's outcome is recorded: a later delivery is acknowledged
    #: without running.
    SUCCEEDED = "succeeded"
    #: An attempt failed and its retry is published.
    RETRY_SCHEDULED = "retry_scheduled"
    #: An interactive run failed (queued runs retry or are dead-lettered).
    FAILED = "failed"
    #: Its attempt stopped without an outcome (worker lost, lease lapsed).
    INTERRUPTED = "interrupted"
    #: A dead letter is decided and not stored yet (the next delivery finishes it).
    DEAD_LETTERING = "dead_lettering"
    #: The task is a dead letter: it runs again only if an operator replays it.
    DEAD_LETTERED = "dead_lettered"
    #: An operator replayed the dead letter; its message is published again.
    REPLAYED = "replayed"
    #: Revoked or expired before its body started; never runs.
    NOT_RUN = "not_run"


class ApprovalState(Choice):
    """Where a call that needs approval stands."""

    __choice_name__ = "an approval state"

    #: Never parked (or its record expired).
    ABSENT = "absent"
    #: Parked: waiting for a person to approve or reject it.
    PENDING = "pending"
    #: Approved by the agent's user, waiting for an operator (a tool whose
    #: approver is :attr:`Approver.BOTH`).
    USER_APPROVED = "user_approved"
    #: Approved: every delivery of its task id runs under the journal's rules.
    APPROVED = "approved"
    #: Rejected by a person: the call ends FAILURE (``ApprovalRejected``), nothing ran.
    REJECTED = "rejected"
    #: Not decided within ``tooleffect_approval_timeout``: rejected as expired.
    EXPIRED = "expired"
    #: A rejected or expired call that a worker ended FAILURE (``ApprovalRejected``).
    ENDED = "ended"


class Approver(Choice):
    """Who approves the calls of a tool that declares ``requires_approval``.

    Whoever it is, the worker enforces the decision: a call runs only once a
    decision for exactly the arguments shown is recorded in the store."""

    __choice_name__ = "an approver"

    #: An operator, from the CLI, Flower or ``Approvals(app)`` (``requires_approval = True``).
    OPERATOR = "operator"
    #: The agent's user, through the agent SDK's own pause and resume or the
    #: MCP client; an operator may decide a call no user was asked about.
    USER = "user"
    #: The agent's user, then an operator, in turn.
    BOTH = "both"

    @property
    def asks_user(self) -> bool:
        """Whether the agent's user decides (first)."""
        return self is not Approver.OPERATOR


def approver_of(declared: Any) -> Approver | None:
    """The approver a ``requires_approval`` value names: True is an operator,
    False or None no approval, else an :class:`Approver` or its value
    (``ValueError`` for anything else)."""
    if declared is None or declared is False:
        return None
    if declared is True:
        return Approver.OPERATOR
    if isinstance(declared, (Approver, str)):
        return Approver.coerce(declared)
    raise ValueError(f"{declared!r} is neither a bool nor an approver "
                     f"({', '.join(a.value for a in Approver)})")


class DeadLetterReason(Choice):
    """Why a task was dead-lettered."""

    __choice_name__ = "a dead-letter reason"

    #: It failed with an error of a class that is never retried.
    NOT_RETRYABLE = "not_retryable"
    #: It kept failing (or being interrupted) until its retry budget was spent.
    RETRIES_EXHAUSTED = "retries_exhausted"
    #: A NON_IDEMPOTENT_WRITE started and never finished: never run twice.
    INTERRUPTED_WRITE = "interrupted_write"
    #: A NON_IDEMPOTENT_WRITE the store has no entry of, published before a
    #: detected rollback of the store: it may have run before (docs/redis.md#rollbacks).
    STORE_ROLLED_BACK = "store_rolled_back"
    #: ``revoke(terminate=True)`` stopped the write while its body ran.
    REVOKED = "revoked"
    #: The worker that took it knows no task of its name (or it has no name).
    UNKNOWN_TASK = "unknown_task"
    #: Its body could not be decoded, or its content type is not accepted.
    UNDECODABLE_MESSAGE = "undecodable_message"
    #: Its headers or body have a shape Celery cannot run, a ``tooleffect_*``
    #: header a producer may not set, or arguments the tool cannot take.
    MALFORMED_MESSAGE = "malformed_message"
    #: Its task id belongs to another call (another tool or other arguments);
    #: kept under its own id
    #: (:func:`~celery_tooleffect.store.dead_letter_record.conflict_letter_id`), never replayed.
    CALL_ID_CONFLICT = "call_id_conflict"


class CallStatus(Choice):
    """Where a tool call stands, as an agent is told (one word for each of
    Celery's result states, the approval and the dead letter behind it)."""

    __choice_name__ = "a call status"

    #: Published; no worker reported it started (Celery: PENDING). Also what
    #: an id nobody published reads as, unless the caller chose it.
    QUEUED = "queued"
    #: A worker runs it, or its retry is scheduled (Celery: STARTED, RETRY;
    #: a write's journal: running).
    RUNNING = "running"
    #: Parked until a person approves or rejects it; nothing of it ran.
    AWAITING_APPROVAL = "awaiting_approval"
    #: It ended with a result.
    SUCCEEDED = "succeeded"
    #: It ended with an error and is no dead letter (an interactive run).
    FAILED = "failed"
    #: It ended as a dead letter: it runs again only if an operator replays it.
    DEAD_LETTERED = "dead_lettered"
    #: A person rejected it, or nobody decided in time; nothing ran.
    REJECTED = "rejected"
    #: Revoked, or its ``expires`` passed, before or while it ran.
    REVOKED = "revoked"
    #: Never published: its arguments do not fit the tool, or its id is
    #: another call's (``CallIdConflict``).
    REFUSED = "refused"
    #: No call of the tools asked about has this id (the status tool's answer
    #: for an id of another task, or one nobody published, or expired).
    UNKNOWN = "unknown"

    @property
    def ended(self) -> bool:
        """True once the call will change no more (without an operator)."""
        return self in _ENDED

    @property
    def is_error(self) -> bool:
        """True for an ending the agent must be told is an error."""
        return self in _ERRORS


_ENDED = frozenset({CallStatus.SUCCEEDED, CallStatus.FAILED, CallStatus.DEAD_LETTERED,
                    CallStatus.REJECTED, CallStatus.REVOKED, CallStatus.REFUSED})
_ERRORS = _ENDED - {CallStatus.SUCCEEDED}
