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


# -- read back from a stream ---------------------------------------------------------


def test_an_event_read_back_is_typed_and_reads_as_its_stored_text() -> None:
    stored = {"seq": "3", **dict(an_event(countdown=1.5)), "ts": "1796345286.29",
              "redelivered": "1", "prev": "ab" * 20, "hash": "cd" * 20}
    event = AuditEvent.from_stream("1796345286290-0", stored)
    # The mapping: the entry id, then the stored text, in stored order, unchanged.
    assert dict(event) == {"id": "1796345286290-0", **stored}
    assert list(event) == ["id", *stored]
    assert event["ts"] == "1796345286.29" and event.get("task_id") == "t-1"
    # The attributes: parsed.
    assert (event.ts, event.attempt, event.duration_ms) == (1796345286.29, 2, 12.5)
    assert event.redelivered is True
    assert (event.seq, event.prev, event.hash, event.entry_id) == (
        3, "ab" * 20, "cd" * 20, "1796345286290-0")
    assert (event.effect, event.failure_class, event.exception_type) == (
        "non_idempotent_write", "connection", "TimeoutError")
    assert dict(event.details) == {"countdown": "1.5"}
    with pytest.raises(TypeError):
        event["status"] = "succeeded"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.seq = 4  # type: ignore[misc]


def test_a_field_that_does_not_parse_reads_as_empty_never_as_an_error() -> None:
    stored = {"run_id": "r", "ts": "soon", "attempt": "2.5", "duration_ms": "nan",
              "seq": "x", "redelivered": "0", "note": "kept"}
    event = AuditEvent.from_stream("1-0", stored)
    assert (event.ts, event.attempt, event.duration_ms, event.seq) == (0.0, None, None, None)
    assert (event.redelivered, event.tool, event.prev, event.hash) == (False, "", None, None)
    assert dict(event) == {"id": "1-0", **stored}
    assert AuditEvent.from_stream("2-0", {"attempt": "3.0"}).attempt == 3  # as Lua may write it


def test_a_read_back_event_rebuilt_keeps_its_stored_layout() -> None:
    stored = {"seq": "1", **dict(an_event()), "prev": "", "hash": "ef" * 20}
    event = AuditEvent.from_stream("5-0", stored)
    rebuilt = dataclasses.replace(event, status="succeeded")
    assert list(rebuilt) == list(event)
    assert rebuilt["status"] == "succeeded" and rebuilt["hash"] == "ef" * 20
    assert {name: value for name, value in rebuilt.items() if name != "status"} == {
        name: value for name, value in event.items() if name != "status"}
