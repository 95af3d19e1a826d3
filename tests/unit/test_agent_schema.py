"""What an agent is told about a tool (celery_tooleffect/agents/schema.py) and
about a call (``CallReport``): pure functions of the tool's code."""

from __future__ import annotations

import datetime
import json
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from celery_tooleffect import ToolEffect, ToolTask
from celery_tooleffect.agents import MAX_ARGUMENT_BYTES, CallReport, ToolSpec
from celery_tooleffect.errors import InvalidToolArguments, ToolSchemaError
from celery_tooleffect.states import CallStatus
from tests.unit.conftest import app_with


class Address(BaseModel):
    street: str
    city: str


def spec_of(function: Any, **options: Any) -> ToolSpec:
    app = app_with()
    task = app.task(base=ToolTask, name=f"t.{function.__name__}", shared=False,
                    **options)(function)
    return ToolSpec.of(task)


def test_the_input_schema_is_the_signature_and_bind_is_left_out() -> None:
    def ship(self: ToolTask, order: str, to: Address, *, express: bool = False,
             note: Annotated[str, Field(description="For the courier")] = "") -> str:
        """Ship an order. Once per order: shipping it twice ships one parcel."""
        return order

    spec = spec_of(ship, bind=True, effect=ToolEffect.IDEMPOTENT_WRITE)
    schema = spec.input_schema
    assert schema["required"] == ["order", "to"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"order", "to", "express", "note"}
    assert schema["properties"]["to"] == {"$ref": "#/$defs/Address"}
    assert schema["$defs"]["Address"]["required"] == ["street", "city"]
    assert schema["properties"]["note"]["description"] == "For the courier"
    assert spec.title == "Ship an order."
    assert spec.description.startswith("Ship an order. Once per order")
    assert spec.annotations == {"title": "Ship an order.", "readOnlyHint": False,
                                "destructiveHint": True, "idempotentHint": True,
                                "openWorldHint": True}
    assert spec.function_name == "t_ship"


def test_the_output_schema_is_an_envelope_around_the_return_type() -> None:
    def lookup(sku: str) -> list[Address]:
        """Where an item is."""
        return [Address(street="1 Main St", city="Springfield")]

    def untyped_result(sku: str):  # type: ignore[no-untyped-def]
        return sku

    envelope = spec_of(lookup).output_schema
    assert envelope is not None
    assert envelope["required"] == ["status", "task_id"]
    assert envelope["properties"]["result"] == {"type": "array",
                                                "items": {"$ref": "#/$defs/Address"}}
    assert "Address" in envelope["$defs"]  # references resolve from the top
    assert envelope["properties"]["status"]["enum"] == list(CallStatus.values())
    assert spec_of(untyped_result).output_schema is None


@pytest.mark.parametrize(("signature", "why"), [
    ("def tool(key): pass", "parameter 'key' has no type annotation: add a type hint"),
    ("def tool(*keys: str) -> None: pass", "*args and **kwargs cannot be described"),
    ("def tool(**keys: str) -> None: pass", "*args and **kwargs cannot be described"),
    ("def tool(key: str, /) -> None: pass", "parameter 'key' is positional-only"),
    ("def tool(when: Clock) -> None: pass", "its arguments cannot be described"),
    ("def tool(key: str) -> Clock: pass", "its return type cannot be described"),
])
def test_a_signature_that_cannot_be_described_is_refused_naming_why(
        signature: str, why: str) -> None:
    class Clock:
        """No schema: pydantic knows nothing of it."""

    namespace: dict[str, Any] = {"Clock": Clock}
    exec(signature, namespace)
    with pytest.raises(ToolSchemaError) as refused:
        spec_of(namespace["tool"])
    assert str(refused.value).startswith("t.tool: ")
    assert why in str(refused.value)


def test_arguments_are_validated_to_their_json_form_leaving_defaults_out() -> None:
    def book(room: Literal["a", "b"], day: datetime.date, guests: int = 1) -> None:
        """Book a room."""

    spec = spec_of(book)
    assert spec.validate({"room": "a", "day": "2026-12-24"}) == {"room": "a",
                                                               "day": "2026-12-24"}
    assert spec.validate('{"room": "b", "day": "2026-12-24", "guests": "2"}') == {
        "room": "b", "day": "2026-12-24", "guests": 2}
    with pytest.raises(InvalidToolArguments) as invalid:
        spec.validate({"room": "c", "guests": "many", "pets": 1})
    fields = {error["field"]: error["type"] for error in invalid.value.errors}
    assert fields == {"room": "literal_error", "day": "missing", "guests": "int_parsing",
                      "pets": "extra_forbidden"}
    assert str(invalid.value).startswith("t.book: invalid arguments: room: ")
    for not_an_object in ("[1, 2]", "null and more", 7):
        with pytest.raises(InvalidToolArguments):
            spec.validate(not_an_object)


def test_arguments_over_the_limit_are_refused_before_they_are_parsed() -> None:
    def note(text: str) -> None:
        """Keep a note."""

    spec = spec_of(note)
    fits = json.dumps({"text": "x" * (MAX_ARGUMENT_BYTES - 20)})
    assert spec.validate(fits)["text"].startswith("x")
    with pytest.raises(InvalidToolArguments, match="a call takes at most 262144"):
        spec.validate(json.dumps({"text": "x" * MAX_ARGUMENT_BYTES}))
    with pytest.raises(InvalidToolArguments, match="a call takes at most 262144"):
        spec.validate({"text": "x" * MAX_ARGUMENT_BYTES})


@pytest.mark.parametrize(("report", "said", "error"), [
    (CallReport("t1", "shop.send", CallStatus.SUCCEEDED, result={"n": 1}), '{"n": 1}', False),
    (CallReport("t1", "shop.send", CallStatus.SUCCEEDED, result="INV-1"), "INV-1", False),
    (CallReport("t1", "shop.send", CallStatus.AWAITING_APPROVAL),
     "waiting for a person's approval; nothing of it has run", False),
    (CallReport("t1", "shop.send", CallStatus.AWAITING_APPROVAL, approver="operator",
                approval_state="pending"),
     "shop.send is waiting for a person's approval; nothing of it has run. Do not call", False),
    (CallReport("t1", "shop.wire", CallStatus.AWAITING_APPROVAL, approver="user",
                approval_state="pending"),
     "did not ask its user (an MCP client without elicitation cannot); nothing of it has "
     "run. An operator can approve it instead: `celery tooleffect approvals approve t1`",
     False),
    (CallReport("t1", "shop.payout", CallStatus.AWAITING_APPROVAL, approver="both",
                approval_state="pending"),
     "An operator cannot approve it before its user does", False),
    (CallReport("t1", "shop.payout", CallStatus.AWAITING_APPROVAL, approver="both",
                approval_state="user_approved"),
     "approved by its user and is waiting for an operator's approval "
     "(`celery tooleffect approvals approve t1`)", False),
    (CallReport("t1", "shop.send", CallStatus.RUNNING), "is running and has not ended", False),
    (CallReport("t1", "shop.send", CallStatus.DEAD_LETTERED, error_type="Declined",
                error="no", failure_class="client_error", dead_letter_reason="not_retryable"),
     "failed (client_error) and was dead-lettered (not_retryable): Declined: no. It will "
     "not be retried", True),
    (CallReport("t1", "shop.send", CallStatus.DEAD_LETTERED, failure_class="unknown",
                dead_letter_reason="interrupted_write"),
     "may or may not have taken effect; do not call it again", True),
    (CallReport("", "shop.send", CallStatus.REFUSED, error="shop.send: invalid arguments: x"),
     "shop.send was not called: invalid arguments: x", True),
    (CallReport("t1", "shop.send", CallStatus.REJECTED, error="rejected by ann"),
     "Nothing of it ran", True),
])
def test_what_the_model_is_told(report: CallReport, said: str, error: bool) -> None:
    assert said in report.message()
    assert report.is_error is error
    data = report.to_dict()
    assert data["status"] == report.status.value and data["message"] == report.message()
    assert ("result" in data) is (report.status is CallStatus.SUCCEEDED)
    json.dumps(data)
