"""The write journal's state machine: which moves between its states are allowed.

The states are :class:`~celery_tooleffect.states.JournalState` and
:class:`~celery_tooleffect.states.ApprovalState` (public names, in
:mod:`celery_tooleffect.states`); this module draws how they move and names
the allowed moves, as sets the journal (Python) and its Lua scripts
(``scripts/*.lua``) share, with the journal's own vocabulary (:class:`Ending`,
:class:`Verdict`). ``tests/test_states.py`` checks that every state, verdict
and effect literal in the scripts is one of them.

States of a task's entry::

    absent --begin_attempt--> running --settle--> succeeded
    interrupted, dead_lettered --reconciled: applied--> succeeded
    interrupted --reconciled: not applied--> running (a new attempt)
                                 |  \\--settle--> retry_scheduled --begin_attempt--> running
                                 |   \\--settle--> failed            (interactive runs)
                                 |----lease lapsed / worker lost--> interrupted
                                 \\--begin_dead_lettering--> dead_lettering --> dead_lettered
    absent, retry_scheduled, replayed, interrupted --revoked/expired--> not_run
    absent, dead_lettering, dead_lettered, interrupted, replayed --replay--> replayed
        (also from succeeded for an IDEMPOTENT_WRITE, and from a running
        entry whose lease lapsed unless it is a NON_IDEMPOTENT_WRITE not forced)

``absent`` is no entry at all: never written, expired (``tooleffect_journal_ttl``)
or lost with a store restarted without persistence. ``succeeded``,
``dead_lettered`` and ``not_run`` are where an entry ends: a later delivery of
the task is acknowledged without running (an operator's replay reopens a
dead-lettered one). The entry also counts how earlier attempts ended
(:class:`Ending`), so that a spent retry budget says what spent it.

A move is fenced by the attempt's owner token: a worker that lost its lease
cannot move the entry, and its outcome is stored as a ``late_outcome`` event.

A call that needs a person's approval has a second, smaller machine
(:class:`ApprovalState`), before any journal entry exists::

    absent --parked by the worker--> pending --approve--> approved
                                     pending --reject--> rejected --worker ends it FAILURE--> ended
                                     pending --timeout--> expired --worker ends it FAILURE--> ended

Who approves is the tool's :class:`~celery_tooleffect.states.Approver`. An
operator approves ``pending`` calls (of a tool approved by ``both``, only once
the user approved: ``user_approved``). The agent's user approves or rejects a
call before it is published (``absent``: the agent SDK's pause) or once it is
parked (``pending``); for a tool approved by both, the user's approval moves
it to ``user_approved``, where it waits for an operator::

    absent or pending --the user approves--> approved (user) | user_approved (both)
    user_approved --an operator approves--> approved

Rejection and expiry are taken from ``pending`` and ``user_approved``. Each
decision is taken once. ``approved`` is where an approved call stays (every
delivery of its task id runs under the journal's rules, if its arguments are
those the decision was shown); ``ended`` is where a refused one stays.
"""

from __future__ import annotations

from ..choices import Choice

# The states themselves are public names (celery_tooleffect.states); imported
# from here too, as they were defined here before.
from ..states import ApprovalState as ApprovalState
from ..states import Approver
from ..states import JournalState as JournalState


class Ending(Choice):
    """How an attempt that may be followed by another one ended (counted per entry)."""

    __choice_name__ = "an attempt ending"

    FAILED = "failed"
    INTERRUPTED = "interrupted"
    REQUESTED = "requested"

    @property
    def counter(self) -> str:
        """The journal field that counts these endings."""
        return f"ended_{self.value}"


class Verdict(Choice):
    """What ``begin_attempt`` decided for a delivery (the first item of its answer)."""

    __choice_name__ = "a begin verdict"

    STARTED = "started"
    DONE = "done"
    DEAD_LETTERED = "dead_lettered"
    DEAD_LETTERING = "dead_lettering"
    OWNED = "owned"
    INTERRUPTED = "interrupted"
    NOT_RUN = "not_run"
    EXHAUSTED = "exhausted"
    #: The task id belongs to another call (another tool or other arguments).
    CONFLICT = "conflict"
    #: The broker lease secured with the intent was refused (nothing recorded).
    LEASE_BUSY = "lease_busy"
    LEASE_LOST = "lease_lost"


class DeliveryAction(Choice):
    """What a delivery does with its :class:`Verdict` (:func:`delivery_action`)."""

    __choice_name__ = "a delivery action"

    #: The intent is recorded: the body runs.
    RUN = "run"
    #: An interactive call that ended before answers with the result its
    #: journal entry kept (a tool called in a tool's body whose parent runs again).
    RETURN_KEPT = "return_kept"
    #: The call ended already (succeeded, dead-lettered, not run): the delivery
    #: is acknowledged without running.
    END_QUIETLY = "end_quietly"
    #: A live owner runs the call: come back when its lease ends.
    DEFER = "defer"
    #: An interrupted NON_IDEMPOTENT_WRITE: ask the tool's ``reconcile``.
    RECONCILE = "reconcile"
    #: Earlier attempts spent the retry budget: a dead letter.
    DEAD_LETTER_EXHAUSTED = "dead_letter_exhausted"
    #: A dead letter was begun and not finished: finish it.
    FINISH_DEAD_LETTER = "finish_dead_letter"
    #: The task id is another call's: refused.
    REFUSE_CONFLICT = "refuse_conflict"
    #: The broker lease secured with the intent was refused: the message was
    #: restored (its other copy runs) ...
    LEASE_LOST = "lease_lost"
    #: ... or kept busy (the delivery ends unrun, as a failure before the body).
    LEASE_BUSY = "lease_busy"


_DELIVERY_ACTIONS: dict[Verdict, DeliveryAction] = {
    Verdict.STARTED: DeliveryAction.RUN,
    Verdict.DONE: DeliveryAction.END_QUIETLY,
    Verdict.DEAD_LETTERED: DeliveryAction.END_QUIETLY,
    Verdict.NOT_RUN: DeliveryAction.END_QUIETLY,
    Verdict.DEAD_LETTERING: DeliveryAction.FINISH_DEAD_LETTER,
    Verdict.OWNED: DeliveryAction.DEFER,
    Verdict.INTERRUPTED: DeliveryAction.RECONCILE,
    Verdict.EXHAUSTED: DeliveryAction.DEAD_LETTER_EXHAUSTED,
    Verdict.CONFLICT: DeliveryAction.REFUSE_CONFLICT,
    Verdict.LEASE_BUSY: DeliveryAction.LEASE_BUSY,
    Verdict.LEASE_LOST: DeliveryAction.LEASE_LOST,
}


def delivery_action(verdict: Verdict, *, interactive: bool, kept_result: bool) -> DeliveryAction:
    """What a delivery does with ``begin_attempt``'s ``verdict``: a pure decision.

    ``interactive``: the call is ``apply()``, eager or direct; ``kept_result``:
    the journal entry answered with a result it kept. Only a finished call
    depends on them: an interactive one answers with its kept result, any
    other delivery of it ends quietly.
    """
    if verdict is Verdict.DONE and interactive and kept_result:
        return DeliveryAction.RETURN_KEPT
    return _DELIVERY_ACTIONS[verdict]


S = JournalState

#: Where an entry ends: a later delivery is acknowledged without running.
SETTLED = frozenset({S.SUCCEEDED, S.DEAD_LETTERED, S.NOT_RUN})
#: What a read-only store (it answers reads, refuses writes) may show to
#: acknowledge a delivery without running it.
ENDED = frozenset({S.SUCCEEDED, S.DEAD_LETTERED})

#: A failed or retried attempt is recorded only by its running owner.
SETTLE_FROM = frozenset({S.RUNNING})
#: Success is also recorded when the entry vanished under its owner (a store
#: restarted without persistence, an evicted key): only the owner knows how
#: the write ended, and recording it keeps a redelivery from running it again.
SUCCEED_FROM = frozenset({S.RUNNING, S.ABSENT})
#: A dead letter may be begun from these; ``running`` only by its owner.
DEAD_LETTER_FROM = frozenset(
    {S.ABSENT, S.RUNNING, S.RETRY_SCHEDULED, S.INTERRUPTED, S.REPLAYED, S.FAILED}
)
#: ... and without the owner token a running attempt is someone else's.
DEAD_LETTER_UNOWNED_FROM = DEAD_LETTER_FROM - {S.RUNNING}
#: A dead letter begun and not finished is finished from here only.
FINISH_DEAD_LETTER_FROM = frozenset({S.DEAD_LETTERING})
#: A worker that lost the pool child running the attempt says so.
INTERRUPT_FROM = frozenset({S.RUNNING})
#: A tool's ``reconcile`` found an interrupted write applied: it succeeded.
RECONCILED_FROM = frozenset({S.INTERRUPTED})
#: ... or found a dead letter's write applied (an operator asked it).
RECONCILED_LETTER_FROM = frozenset({S.DEAD_LETTERED, S.ABSENT})
#: A revoked or expired task ends without running from these: no attempt of
#: it runs now (an interrupted NON_IDEMPOTENT_WRITE becomes a dead letter
#: instead, as its next delivery would make it).
NOT_RUN_FROM = frozenset({S.ABSENT, S.RETRY_SCHEDULED, S.REPLAYED, S.INTERRUPTED})
NOT_RUN_UNSAFE_FROM = NOT_RUN_FROM - {S.INTERRUPTED}
#: An operator's replay starts from these (``absent``: no entry, or it expired).
REPLAY_FROM = frozenset({S.ABSENT, S.DEAD_LETTERED, S.DEAD_LETTERING, S.INTERRUPTED, S.REPLAYED})
#: ... and, for an IDEMPOTENT_WRITE, from ``succeeded`` (running it again is safe).
REPLAY_IDEMPOTENT_FROM = REPLAY_FROM | {S.SUCCEEDED}
#: ``begin_attempt`` starts an attempt from these (``running`` only when its
#: lease lapsed; ``interrupted`` only for a write that may run twice); the
#: others answer a verdict without running.
BEGIN_FROM = frozenset(
    {S.ABSENT, S.RUNNING, S.RETRY_SCHEDULED, S.INTERRUPTED, S.REPLAYED, S.FAILED}
)

#: Every move, as the state it goes to and the states it may come from: the
#: diagram above, checked against the sets by ``tests/test_states.py``.
TRANSITIONS: dict[JournalState, frozenset[JournalState]] = {
    S.RUNNING: BEGIN_FROM,
    S.SUCCEEDED: SUCCEED_FROM | RECONCILED_FROM | RECONCILED_LETTER_FROM,
    S.RETRY_SCHEDULED: SETTLE_FROM,
    S.FAILED: SETTLE_FROM,
    S.INTERRUPTED: INTERRUPT_FROM,
    S.DEAD_LETTERING: DEAD_LETTER_FROM,
    S.DEAD_LETTERED: FINISH_DEAD_LETTER_FROM,
    S.NOT_RUN: NOT_RUN_FROM,
    # replay.lua also takes a running entry whose lease lapsed (see above).
    S.REPLAYED: REPLAY_IDEMPOTENT_FROM | {S.RUNNING},
}


def allowed_argument(states: frozenset[JournalState]) -> str:
    """``states`` as a script's ARGV takes them: values joined by spaces, sorted."""
    return " ".join(sorted(state.value for state in states))


A = ApprovalState

#: A rejection or an expiry is taken from here only: once.
DECIDE_FROM = frozenset({A.PENDING, A.USER_APPROVED})
#: The agent's user decides a parked call from here (a call not yet
#: published has no record: ``absent``).
USER_DECIDE_FROM = frozenset({A.PENDING})
#: A worker ends a refused call FAILURE from these (and an approved one whose
#: arguments are not those the decision was shown).
END_REFUSED_FROM = frozenset({A.REJECTED, A.EXPIRED})
#: Refused: the call never runs.
REFUSED = END_REFUSED_FROM | {A.ENDED}


def operator_approves_from(approver: Approver) -> frozenset[ApprovalState]:
    """Where an operator's approval is taken from: a tool approved by both
    waits for its user first."""
    return frozenset({A.USER_APPROVED}) if approver is Approver.BOTH else frozenset({A.PENDING})


#: Every move of an approval, as :data:`TRANSITIONS` for the journal.
APPROVAL_TRANSITIONS: dict[ApprovalState, frozenset[ApprovalState]] = {
    A.PENDING: frozenset({A.ABSENT}),
    A.USER_APPROVED: frozenset({A.ABSENT, A.PENDING}),
    A.APPROVED: frozenset({A.ABSENT, A.PENDING, A.USER_APPROVED}),
    A.REJECTED: frozenset({A.ABSENT}) | DECIDE_FROM,
    A.EXPIRED: DECIDE_FROM,
    A.ENDED: END_REFUSED_FROM | {A.APPROVED},
}


def approval_argument(states: frozenset[ApprovalState]) -> str:
    """``states`` as an approval script's ARGV takes them (values joined by spaces)."""
    return " ".join(sorted(state.value for state in states))
