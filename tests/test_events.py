"""AuditEvent: one typed, frozen record, stored as the flat fields the docs list."""

from __future__ import annotations

import dataclasses

import pytest

from celery_tooleffect import AuditEvent, FailureClass, ToolEffect
from celery_tooleffect.events import EVENT_FIELDS


def an_event(**details: object) -> AuditEvent:
    return AuditEvent.of(
        run_id="run-1", task_id="t-1", tool="tools.charge",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, phase="outcome", status="failed",
        worker="host:1", queue="tools", attempt=2, duration_ms=12.5,
        failure_class=FailureClass.CONNECTION, exception=TimeoutError("slow"), **details,
    )


def test_an_event_is_stored_as_text_fields_in_the_documented_order() -> None:
    event = an_event(countdown=1.5, requested=True, skipped=None)
    fields = dict(event)
    common = [name for name in fields if name in EVENT_FIELDS]
    assert common == [name for name in EVENT_FIELDS if name in fields]
    assert list(fields)[len(common):] == ["countdown", "requested"]
    assert fields["effect"] == "non_idempotent_write"
    assert fields["failure_class"] == "connection"
    assert fields["exception_type"] == "TimeoutError"
    assert "slow" not in "".join(fields.values())  # the message is not metadata
    assert (fields["attempt"], fields["duration_ms"]) == ("2", "12.500")
    assert (fields["countdown"], fields["requested"], fields["redelivered"]) == ("1.5", "1", "0")
    assert all(isinstance(value, str) for value in fields.values())


def test_an_event_is_frozen_and_amended_into_a_new_one() -> None:
    event = an_event()
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.status = "succeeded"  # type: ignore[misc]
    retrying = event.amended(status="retrying", countdown=3)
    assert (event["status"], retrying["status"], retrying["countdown"]) == (
        "failed", "retrying", "3")
    assert "countdown" not in event


def test_a_detail_cannot_replace_a_common_or_chain_field() -> None:
    for name in ("status", "run_id", "exception_type", "seq", "hash", "prev"):
        with pytest.raises(ValueError, match="would replace"):
            dataclasses.replace(an_event(), details={name: "forged"})
    with pytest.raises(ValueError, match="would replace"):
        an_event().amended(seq="1")
