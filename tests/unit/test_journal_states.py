"""The journal's and the approvals' state machines (celery_tooleffect/store/states.py)
as tables: what each move may start from, walked without a store.

tests/test_states.py checks the tables against the Lua scripts; here, the
rules the tables themselves must keep, whatever the scripts do with them.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.choices import Choice
from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.failures import FailureClass
from celery_tooleffect.states import Approver
from celery_tooleffect.store import states
from celery_tooleffect.store.dead_letters import DeadLetterReason
from celery_tooleffect.store.states import (
    APPROVAL_TRANSITIONS,
    TRANSITIONS,
    ApprovalState,
    Ending,
    JournalState,
    Verdict,
    allowed_argument,
    approval_argument,
)

S = JournalState
A = ApprovalState
PROPERTIES = settings(max_examples=300, deadline=None, database=None)


def moves_from(state: JournalState) -> set[JournalState]:
    return {target for target, sources in TRANSITIONS.items() if state in sources}


def reachable(start: JournalState, without: frozenset[JournalState] = frozenset()) -> set[S]:
    """The states reachable from ``start`` by moves not going to ``without``."""
    seen, queue = {start}, deque([start])
    while queue:
        for target in moves_from(queue.popleft()) - without:
            if target not in seen:
                seen.add(target)
                queue.append(target)
    return seen


def test_every_set_names_journal_states_only() -> None:
    for name in dir(states):
        value = getattr(states, name)
        if isinstance(value, frozenset) and name.isupper():
            kinds = {type(member) for member in value}
            assert kinds in ({JournalState}, {ApprovalState}), name


def test_a_settled_entry_never_begins_again_without_an_operator() -> None:
    """From succeeded, dead_lettered or not_run no move leads to running
    unless it goes through an operator's replay."""
    for settled in states.SETTLED:
        assert S.RUNNING not in moves_from(settled)
        assert S.RUNNING not in reachable(settled, without=frozenset({S.REPLAYED}))


def test_only_the_running_owner_settles_an_attempt() -> None:
    assert states.SETTLE_FROM == {S.RUNNING} == states.INTERRUPT_FROM
    assert TRANSITIONS[S.RETRY_SCHEDULED] == TRANSITIONS[S.FAILED] == {S.RUNNING}
    # Without the owner token, a running attempt is someone else's.
    assert states.DEAD_LETTER_FROM - {S.RUNNING} == states.DEAD_LETTER_UNOWNED_FROM
    assert S.RUNNING in states.DEAD_LETTER_FROM


def test_success_is_recorded_from_running_or_a_vanished_entry_only() -> None:
    assert {S.RUNNING, S.ABSENT} == states.SUCCEED_FROM
    assert {S.INTERRUPTED} == states.RECONCILED_FROM
    assert {S.DEAD_LETTERED, S.ABSENT} == states.RECONCILED_LETTER_FROM
    # Nothing else moves into succeeded.
    assert TRANSITIONS[S.SUCCEEDED] == (states.SUCCEED_FROM | states.RECONCILED_FROM
                                        | states.RECONCILED_LETTER_FROM)


def test_an_interrupted_write_is_never_ended_not_run_unsafely() -> None:
    """An interrupted NON_IDEMPOTENT_WRITE may have written: revoking it
    cannot say it did not run."""
    assert S.INTERRUPTED in states.NOT_RUN_FROM
    assert S.INTERRUPTED not in states.NOT_RUN_UNSAFE_FROM
    assert not states.NOT_RUN_FROM & {S.RUNNING, S.SUCCEEDED, S.DEAD_LETTERED}


def test_a_replay_reopens_what_ended_badly_and_a_success_only_when_safe() -> None:
    assert S.SUCCEEDED not in states.REPLAY_FROM
    assert states.REPLAY_FROM | {S.SUCCEEDED} == states.REPLAY_IDEMPOTENT_FROM
    assert {S.DEAD_LETTERED, S.DEAD_LETTERING, S.INTERRUPTED} <= states.REPLAY_FROM
    assert S.NOT_RUN not in states.REPLAY_IDEMPOTENT_FROM


def test_a_dead_letter_is_finished_only_once_it_was_begun() -> None:
    assert {S.DEAD_LETTERING} == states.FINISH_DEAD_LETTER_FROM
    assert TRANSITIONS[S.DEAD_LETTERED] == {S.DEAD_LETTERING}
    assert not states.DEAD_LETTER_FROM & states.SETTLED


def test_ended_is_what_a_read_only_store_may_acknowledge() -> None:
    assert states.ENDED < states.SETTLED
    assert S.NOT_RUN not in states.ENDED


def test_every_state_is_reachable_from_absent_and_can_end() -> None:
    assert reachable(S.ABSENT) == set(JournalState)
    for state in JournalState:
        assert reachable(state) & states.SETTLED, state


@PROPERTIES
@given(st.lists(st.sampled_from(list(JournalState)), max_size=40))
def test_on_any_walk_an_ended_entry_runs_again_only_after_a_replay(
        wanted: list[JournalState]) -> None:
    """A random walk over the allowed moves (each step takes the move towards
    the state drawn, when it is allowed): once the entry has settled, it
    reaches ``running`` again only through ``replayed``."""
    state, settled = S.ABSENT, False
    for target in wanted:
        if state not in TRANSITIONS.get(target, frozenset()):
            continue
        state = target
        if state in states.SETTLED:
            settled = True
        elif state is S.REPLAYED:
            settled = False
        elif state is S.RUNNING:
            assert not settled, "a settled entry began again without a replay"


@pytest.mark.parametrize("allowed", [states.SETTLE_FROM, states.DEAD_LETTER_FROM,
                                     states.REPLAY_IDEMPOTENT_FROM, frozenset()])
def test_scripts_get_the_allowed_states_as_sorted_values(
        allowed: frozenset[JournalState]) -> None:
    text = allowed_argument(allowed)
    assert text.split() == sorted(state.value for state in allowed)
    assert {JournalState.coerce(value) for value in text.split()} == allowed


def test_ending_counters_are_journal_fields_of_their_own() -> None:
    assert [ending.counter for ending in Ending] == [
        "ended_failed", "ended_interrupted", "ended_requested"]


# -- approvals ----------------------------------------------------------------------


def test_a_decision_is_taken_once_from_a_call_waiting_for_it() -> None:
    # The user decides before the call is published (absent) or once it is
    # parked; an operator then, or alone; rejection and expiry from either wait.
    assert APPROVAL_TRANSITIONS[A.PENDING] == {A.ABSENT}
    assert APPROVAL_TRANSITIONS[A.USER_APPROVED] == {A.ABSENT, A.PENDING}
    assert APPROVAL_TRANSITIONS[A.APPROVED] == {A.ABSENT, A.PENDING, A.USER_APPROVED}
    assert APPROVAL_TRANSITIONS[A.REJECTED] == {A.ABSENT, A.PENDING, A.USER_APPROVED}
    assert APPROVAL_TRANSITIONS[A.EXPIRED] == states.DECIDE_FROM == {A.PENDING,
                                                                     A.USER_APPROVED}
    assert {A.PENDING} == states.USER_DECIDE_FROM
    assert states.operator_approves_from(Approver.BOTH) == {A.USER_APPROVED}
    assert states.operator_approves_from(Approver.USER) == {A.PENDING}
    assert states.operator_approves_from(Approver.OPERATOR) == {A.PENDING}
    # A refused call ends; an approved one ends only when its arguments are not
    # those its user was shown.
    assert APPROVAL_TRANSITIONS[A.ENDED] == states.END_REFUSED_FROM | {A.APPROVED}
    assert {A.REJECTED, A.EXPIRED} == states.END_REFUSED_FROM
    assert {A.REJECTED, A.EXPIRED, A.ENDED} == states.REFUSED
    # An approved call never becomes refused by a decision, nor a refused one approved.
    for source in states.REFUSED:
        assert source not in APPROVAL_TRANSITIONS[A.APPROVED]
        assert source not in APPROVAL_TRANSITIONS[A.USER_APPROVED]
    for target in (A.USER_APPROVED, A.REJECTED, A.EXPIRED):
        assert A.APPROVED not in APPROVAL_TRANSITIONS[target]
    assert approval_argument(states.END_REFUSED_FROM) == "expired rejected"


# -- the choices: from configuration and messages -------------------------------------


CHOICES: list[type[Choice]] = [JournalState, Ending, Verdict, ApprovalState, ToolEffect,
                               FailureClass, DeadLetterReason]


@pytest.mark.parametrize("kind", CHOICES)
def test_a_choice_takes_its_member_or_its_value_in_any_case(kind: type[Choice]) -> None:
    values = kind.values()
    assert len(set(values)) == len(values) == len(kind)
    for member in kind:
        assert kind.coerce(member) is member
        assert kind.coerce(member.value) is member
        assert kind.coerce(member.value.upper()) is member
        assert str(member) == member.value == member  # a str enum
    with pytest.raises(ValueError) as refused:
        kind.coerce("no such thing")
    assert str(refused.value).startswith(f"not {kind.__choice_name__}: 'no such thing'")
    assert all(value in str(refused.value) for value in values)
    with pytest.raises(ValueError):
        kind.coerce(None)


@PROPERTIES
@given(st.text(max_size=20))
def test_coerce_either_answers_a_member_or_refuses_clearly(text: str) -> None:
    try:
        member = JournalState.coerce(text)
    except ValueError as refused:
        assert "not a journal state" in str(refused)
        assert text.lower() not in JournalState.values()
    else:
        assert member.value == text.lower()
