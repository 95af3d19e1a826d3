"""What a delivery does with ``begin_attempt``'s verdict
(:func:`celery_tooleffect.store.states.delivery_action`): a pure decision,
checked verdict by verdict, for queued and interactive calls, with and
without a kept result."""

from __future__ import annotations

import itertools

import pytest

from celery_tooleffect.store.states import DeliveryAction, Verdict, delivery_action

A = DeliveryAction

#: The verdict's action whatever the call (queued or interactive, a kept result or not).
WHATEVER_THE_CALL = [
    (Verdict.STARTED, A.RUN),
    (Verdict.DEAD_LETTERED, A.END_QUIETLY),
    (Verdict.NOT_RUN, A.END_QUIETLY),
    (Verdict.DEAD_LETTERING, A.FINISH_DEAD_LETTER),
    (Verdict.OWNED, A.DEFER),
    (Verdict.INTERRUPTED, A.RECONCILE),
    (Verdict.EXHAUSTED, A.DEAD_LETTER_EXHAUSTED),
    (Verdict.CONFLICT, A.REFUSE_CONFLICT),
    (Verdict.LEASE_BUSY, A.LEASE_BUSY),
    (Verdict.LEASE_LOST, A.LEASE_LOST),
]
FACTS = list(itertools.product([False, True], repeat=2))


@pytest.mark.parametrize(("verdict", "action"), WHATEVER_THE_CALL)
@pytest.mark.parametrize(("interactive", "kept_result"), FACTS)
def test_a_verdict_decides_the_same_action_for_every_call(
        verdict: Verdict, action: DeliveryAction, interactive: bool, kept_result: bool) -> None:
    assert delivery_action(verdict, interactive=interactive, kept_result=kept_result) is action


def test_an_interactive_call_that_ended_with_a_kept_result_answers_with_it() -> None:
    assert delivery_action(Verdict.DONE, interactive=True, kept_result=True) is A.RETURN_KEPT


@pytest.mark.parametrize(("interactive", "kept_result"), [(False, False), (False, True),
                                                          (True, False)])
def test_any_other_delivery_of_a_call_that_ended_ends_quietly(
        interactive: bool, kept_result: bool) -> None:
    assert delivery_action(Verdict.DONE, interactive=interactive,
                           kept_result=kept_result) is A.END_QUIETLY


def test_every_verdict_is_decided_and_every_action_is_reachable() -> None:
    decided = {delivery_action(verdict, interactive=interactive, kept_result=kept)
               for verdict in Verdict for interactive, kept in FACTS}
    assert decided == set(DeliveryAction)
    assert {verdict for verdict, _ in WHATEVER_THE_CALL} | {Verdict.DONE} == set(Verdict)
