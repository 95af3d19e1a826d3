"""The effect a call is handled as (:func:`celery_tooleffect.worker.attempt.handled_as`):
the strictest of the one its tool declares and the one its journal entry
records, decided in one place for the pool process and the main process."""

from __future__ import annotations

import pytest

from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.worker.attempt import Attempt, handled_as

READ, IDEMPOTENT, WRITE = (ToolEffect.READ_ONLY, ToolEffect.IDEMPOTENT_WRITE,
                           ToolEffect.NON_IDEMPOTENT_WRITE)


def attempt(effect: ToolEffect) -> Attempt:
    return Attempt(task_id="t", run_id="r", name="tools.t", effect=effect, queue="q",
                   token="tok", redelivered=False, interactive=False, retries=0)


@pytest.mark.parametrize(("declared", "recorded", "handled"), [
    (READ, WRITE, WRITE), (READ, IDEMPOTENT.value, IDEMPOTENT), (IDEMPOTENT, WRITE, WRITE),
    (WRITE, READ, WRITE), (IDEMPOTENT, READ.value, IDEMPOTENT), (READ, READ, READ),
])
def test_the_strictest_of_the_declared_and_the_recorded_effect_wins(
        declared: ToolEffect, recorded: ToolEffect | str, handled: ToolEffect) -> None:
    assert handled_as(attempt(declared), recorded).effect is handled


@pytest.mark.parametrize("recorded", [None, ""])
def test_nothing_recorded_changes_nothing(recorded: str | None) -> None:
    declared = attempt(READ)
    assert handled_as(declared, recorded) is declared


def test_a_recorded_name_that_is_no_effect_counts_as_the_strictest() -> None:
    assert handled_as(attempt(READ), "from_a_future_release").effect is WRITE


def test_only_the_effect_changes() -> None:
    declared = attempt(READ)
    handled = handled_as(declared, WRITE)
    assert handled == attempt(WRITE) and declared.effect is READ
