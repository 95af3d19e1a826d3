"""The retry policy (celery_tooleffect/worker/retries.py): one budget per tool,
one decision per failure, the countdown of each retry."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from celery import Task
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.errors import NoSideEffect, ToolDeclarationError
from celery_tooleffect.failures import FailureClass
from celery_tooleffect.settings import settings_for
from celery_tooleffect.store.states import Ending
from celery_tooleffect.worker.retries import (
    Decision,
    RetryPolicy,
    budget_of,
    declared_max_retries,
    exhausted_text,
    refuse_autoretry,
    refuse_unbounded_retries,
)
from tests.unit.conftest import app_with

PROPERTIES = settings(max_examples=300, deadline=None, database=None)

SETTINGS = settings_for(app_with(tooleffect_max_retries=3, tooleffect_backoff_base=2.0,
                                 tooleffect_backoff_cap=60.0))


def policy(effect: ToolEffect = ToolEffect.IDEMPOTENT_WRITE, budget: int = 3,
           **options: Any) -> RetryPolicy:
    return RetryPolicy(budget=budget, effect=effect, settings=SETTINGS, **options)


class Quota(Exception):
    """A provider's refusal the tool lists in autoretry_for (UNKNOWN to the classifier)."""


def decide(chosen: RetryPolicy, exc: BaseException,
           failure_class: FailureClass = FailureClass.CONNECTION, *, attempt: int = 1,
           retries: int = 0, body_started: bool = True) -> Decision:
    return chosen.after_failure(exc, failure_class, retries=retries, attempt=attempt,
                                body_started=body_started)


# -- the decision ---------------------------------------------------------------------


def test_a_retryable_failure_is_retried_with_the_package_s_backoff() -> None:
    for retries, wait in ((0, 2.0), (1, 4.0), (4, 32.0), (5, 60.0), (9, 60.0)):
        decision = decide(policy(budget=10), ConnectionError(), attempt=retries + 1,
                          retries=retries)
        assert decision == Decision(retry=True, countdown=wait)


@pytest.mark.parametrize("failure_class", [c for c in FailureClass if not c.retryable])
def test_a_failure_that_is_not_retryable_ends_now(failure_class: FailureClass) -> None:
    assert decide(policy(), ValueError(), failure_class) == Decision(retry=False)


@pytest.mark.parametrize("failure_class", [c for c in FailureClass if c.retryable])
def test_a_retryable_failure_past_the_budget_is_exhausted(failure_class: FailureClass) -> None:
    assert decide(policy(budget=3), ConnectionError(), failure_class, attempt=3).retry
    assert decide(policy(budget=3), ConnectionError(), failure_class, attempt=4) == Decision(
        retry=False, exhausted=True)
    assert decide(policy(budget=0), ConnectionError(), failure_class, attempt=1).exhausted


def test_a_non_idempotent_write_is_never_retried_once_its_body_started() -> None:
    write = policy(ToolEffect.NON_IDEMPOTENT_WRITE)
    assert decide(write, ConnectionError()) == Decision(retry=False)
    # ... unless nothing was written, or the body never started.
    assert decide(write, NoSideEffect(ConnectionError())).retry
    marked = ConnectionError()
    marked.no_side_effect = True  # type: ignore[attr-defined]
    assert decide(write, marked).retry
    assert decide(write, ConnectionError(), body_started=False).retry


def test_autoretry_for_retries_what_the_classifier_would_not() -> None:
    listed = policy(autoretry_for=(Quota,))
    assert decide(listed, Quota(), FailureClass.UNKNOWN).retry
    assert not decide(listed, ValueError(), FailureClass.UNKNOWN).retry
    # Its retries spend the same budget.
    assert decide(listed, Quota(), FailureClass.UNKNOWN, attempt=4).exhausted


def test_dont_autoretry_for_wins_over_everything() -> None:
    refused = policy(autoretry_for=(OSError,), dont_autoretry_for=(ConnectionResetError,))
    assert decide(refused, ConnectionResetError(), FailureClass.CONNECTION) == Decision(
        retry=False)
    assert decide(refused, ConnectionError(), FailureClass.CONNECTION).retry


def test_the_countdown_of_an_autoretry() -> None:
    # retry_kwargs' countdown, for what autoretry_for names only.
    fixed = policy(autoretry_for=(Quota,), autoretry_countdown=7.0)
    assert decide(fixed, Quota(), FailureClass.UNKNOWN, retries=5, attempt=1).countdown == 7.0
    assert decide(fixed, ConnectionError(), retries=1, attempt=2).countdown == 4.0
    # Celery's exponential backoff (without jitter: exact).
    backoff = policy(autoretry_for=(Quota,), retry_backoff=3, retry_backoff_max=100,
                     retry_jitter=False)
    assert [backoff.countdown(n, autoretried=True) for n in range(7)] == [
        3, 6, 12, 24, 48, 96, 100]
    assert backoff.countdown(2) == SETTINGS.backoff(2)  # a failure it does not name


@PROPERTIES
@given(retries=st.integers(0, 30), factor=st.integers(1, 50), maximum=st.integers(1, 1000))
def test_a_jittered_backoff_stays_within_its_maximum(retries: int, factor: int,
                                                    maximum: int) -> None:
    jittered = policy(autoretry_for=(Quota,), retry_backoff=factor, retry_backoff_max=maximum)
    wait = jittered.countdown(retries, autoretried=True)
    assert 0 <= wait <= min(factor * 2 ** retries, maximum)


EFFECTS = st.sampled_from(list(ToolEffect))
CLASSES = st.sampled_from(list(FailureClass))
ERRORS = st.sampled_from([ConnectionError(), ValueError(), Quota(), ConnectionResetError(),
                          NoSideEffect(ConnectionError()), TimeoutError()])


@PROPERTIES
@given(effect=EFFECTS, failure_class=CLASSES, exc=ERRORS, budget=st.integers(0, 6),
       attempt=st.integers(1, 9), started=st.booleans(),
       autoretry=st.sampled_from([(), (Quota,), (OSError,)]),
       dont=st.sampled_from([(), (ConnectionResetError,)]),
       countdown=st.none() | st.floats(0, 500), backoff=st.integers(0, 8))
def test_every_decision_keeps_the_rules(
        effect: ToolEffect, failure_class: FailureClass, exc: BaseException, budget: int,
        attempt: int, started: bool, autoretry: tuple[type[BaseException], ...],
        dont: tuple[type[BaseException], ...], countdown: float | None, backoff: int) -> None:
    chosen = policy(effect, budget, autoretry_for=autoretry, dont_autoretry_for=dont,
                    autoretry_countdown=countdown, retry_backoff=backoff)
    decision = decide(chosen, exc, failure_class, attempt=attempt, retries=attempt - 1,
                      body_started=started)
    # Never past the budget, and exhausted only past it.
    if decision.retry:
        assert attempt <= budget and not decision.exhausted
        assert 0 <= decision.countdown <= chosen.longest_countdown()
    if decision.exhausted:
        assert not decision.retry and attempt > budget
    if not decision.retry:
        assert decision.countdown == 0
    # A write that may have happened is never run again by a failure.
    if (effect is ToolEffect.NON_IDEMPOTENT_WRITE and started
            and not isinstance(exc, NoSideEffect)):
        assert not decision.retry and not decision.exhausted
    if isinstance(exc, dont):
        assert decision == Decision(retry=False)
    # Something retried at one attempt is retried at every earlier one.
    if decision.retry and attempt > 1:
        assert decide(chosen, exc, failure_class, attempt=attempt - 1, retries=attempt - 2,
                      body_started=started).retry
    # What neither the classifier nor autoretry_for retries is never retried.
    if not failure_class.retryable and not isinstance(exc, autoretry or ()):
        assert not decision.retry and not decision.exhausted


def test_attempts_allowed_are_the_first_and_its_retries() -> None:
    assert policy(budget=0).attempts_allowed == 1
    assert policy(budget=3).attempts_allowed == 4


def test_the_longest_countdown_bounds_every_kind_of_retry() -> None:
    assert policy().longest_countdown() == SETTINGS.backoff_cap
    assert policy(autoretry_for=(Quota,), autoretry_countdown=900.0).longest_countdown() == 900
    assert policy(autoretry_for=(Quota,), autoretry_countdown=5.0).longest_countdown() == 60
    assert policy(autoretry_for=(Quota,), retry_backoff=1,
                  retry_backoff_max=3600).longest_countdown() == 3600


# -- the budget a tool declares ----------------------------------------------------------


class Plain(Task):  # type: ignore[misc]
    name = "t.plain"


class Declared(Task):  # type: ignore[misc]
    name = "t.declared"
    max_retries = 5


class Forever(Task):  # type: ignore[misc]
    name = "t.forever"
    max_retries = None


class FromDeclared(Declared):
    name = "t.from_declared"


def test_the_budget_is_the_tool_s_own_else_the_app_s() -> None:
    assert declared_max_retries(Plain) == (False, None)  # Celery's 3 is a default only
    assert budget_of(Plain(), SETTINGS) == SETTINGS.max_retries
    assert declared_max_retries(Declared) == (True, 5)
    assert budget_of(Declared(), SETTINGS) == 5
    assert budget_of(FromDeclared(), SETTINGS) == 5  # inherited from a tool class
    kwargs = Plain()
    kwargs.retry_kwargs = {"max_retries": 1}
    assert declared_max_retries(kwargs) == (True, 1)
    assert budget_of(kwargs, SETTINGS) == 1


def test_retry_forever_is_refused_on_a_tool() -> None:
    with pytest.raises(ToolDeclarationError, match=r"max_retries=None \(retry forever\)"):
        budget_of(Forever(), SETTINGS)
    with pytest.raises(ToolDeclarationError):
        refuse_unbounded_retries(Forever)
    refuse_unbounded_retries(Declared)  # a number is fine


def test_the_policy_is_read_from_the_tool_s_declaration() -> None:
    tool = Declared()
    tool.autoretry_for = (Quota,)
    tool.dont_autoretry_for = (ValueError,)
    tool.retry_backoff = True
    tool.retry_backoff_max = 120
    tool.retry_jitter = False
    tool.retry_kwargs = {"countdown": 9}
    read = RetryPolicy.of(tool, SETTINGS, ToolEffect.READ_ONLY)
    assert read == RetryPolicy(budget=5, effect=ToolEffect.READ_ONLY, settings=SETTINGS,
                               autoretry_for=(Quota,), dont_autoretry_for=(ValueError,),
                               retry_backoff=1.0, retry_backoff_max=120, retry_jitter=False,
                               autoretry_countdown=9.0)
    plain = RetryPolicy.of(Plain(), SETTINGS, ToolEffect.IDEMPOTENT_WRITE)
    assert (plain.budget, plain.autoretry_for, plain.autoretry_countdown) == (3, (), None)


def test_autoretry_for_is_refused_on_a_non_idempotent_write() -> None:
    tool = Plain()
    tool.autoretry_for = (ConnectionError, Quota)
    with pytest.raises(ToolDeclarationError) as refused:
        refuse_autoretry(tool, ToolEffect.NON_IDEMPOTENT_WRITE)
    assert "autoretry_for=(ConnectionError, Quota) is refused on a NON_IDEMPOTENT_WRITE" in str(
        refused.value)
    for effect in (ToolEffect.READ_ONLY, ToolEffect.IDEMPOTENT_WRITE):
        refuse_autoretry(tool, effect)
    refuse_autoretry(Plain(), ToolEffect.NON_IDEMPOTENT_WRITE)  # none listed


def test_what_spent_a_budget_is_said_in_words() -> None:
    text = exhausted_text("tools.charge", "t-1", attempts=4, budget=3, endings={
        Ending.FAILED: 1, Ending.INTERRUPTED: 2, Ending.REQUESTED: 1})
    assert text.startswith("tools.charge[t-1] not run again: its retry budget of 3 is spent "
                           "after 4 attempt(s): ")
    assert ("1 failed with a retryable error; 2 interrupted (worker lost, pool child killed "
            "or time limit); 1 ended by a retry the tool asked for (self.retry())") in text
    assert exhausted_text("t", "i", attempts=1, budget=0, endings={}).endswith(
        "earlier attempts")
    assert "failed" not in exhausted_text("t", "i", attempts=2, budget=1,
                                          endings={Ending.FAILED: 0, Ending.INTERRUPTED: 2})


def test_decisions_are_values() -> None:
    assert Decision(retry=False) == Decision(retry=False, countdown=0.0, exhausted=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Decision(retry=True).retry = False  # type: ignore[misc]
