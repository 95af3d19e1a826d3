"""A call's identity (celery_tooleffect/identity.py) and an attempt's
(celery_tooleffect/worker/attempt.py): pure functions, the same in a
producer, a worker and a tool's body."""

from __future__ import annotations

import datetime
import decimal
import os
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.errors import InvalidCallId
from celery_tooleffect.identity import (
    CALLER_HEADER,
    MAX_CALLER_LENGTH,
    MAX_ID_LENGTH,
    NAMESPACE,
    RUN_ID_HEADER,
    call_digest,
    call_task_id,
    checked_id,
    child_task_id,
    conflict_text,
    publish_digest,
)
from celery_tooleffect.store.envelope import REPLAY_HEADER
from celery_tooleffect.worker.attempt import (
    AGAIN_HEADER,
    ALLOWED_HEADERS,
    Attempt,
    caller_of,
    delivered_again,
    forged_headers,
    idempotency_key,
    new_token,
    queue_name,
    resolve_run_id,
)
from celery_tooleffect.worker.handoff import HANDOFF_FIELD, NOTES_FIELD

PROPERTIES = settings(max_examples=200, deadline=None, database=None)
#: Each example goes through three serializers: fewer of them.
SERIALIZED = settings(max_examples=60, deadline=None, database=None)

IDS = st.text(min_size=1, max_size=40)
#: msgpack (one of the serializers below) holds 64-bit integers only.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.text(max_size=10)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=4),
    max_leaves=10,
)
ARGS = st.lists(JSON_VALUES, max_size=4)
KWARGS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)


@PROPERTIES
@given(call=IDS, run=st.text(max_size=40), other=IDS)
def test_a_call_id_is_the_same_call_whoever_computes_it(call: str, run: str, other: str) -> None:
    task_id = call_task_id(call, run)
    assert task_id == call_task_id(call, run)
    assert uuid.UUID(task_id).version == 5
    assert (task_id == call_task_id(other, run)) is (other == call)
    if "\n" not in run + call:  # the ids every release gave: unchanged
        assert task_id == str(uuid.uuid5(NAMESPACE, f"call\n{run}\n{call}"))


def test_a_call_id_is_bound_to_its_run() -> None:
    assert call_task_id("c", "run-1") != call_task_id("c", "run-2") != call_task_id("c")


def test_two_different_pairs_never_give_one_id() -> None:
    """Found by this layer: the parts were joined by newlines that a part may
    hold, so ("b\\nc", "a") and ("c", "a\\nb") gave one id."""
    assert call_task_id("b\nc", "a") != call_task_id("c", "a\nb")
    assert idempotency_key("a\nb", "c") != idempotency_key("a", "b\nc")
    assert child_task_id("p", "t\nx", "k") != child_task_id("p", "t", "x\nk")


@PROPERTIES
@given(parent=IDS, child=IDS, key=st.text(max_size=10))
def test_a_child_id_derives_from_its_parent_tool_and_key(parent: str, child: str,
                                                        key: str) -> None:
    task_id = child_task_id(parent, child, key)
    assert task_id == child_task_id(parent, child, key)
    assert task_id != child_task_id(parent + "x", child, key)
    assert task_id != child_task_id(parent, child, key + "#")
    assert task_id != call_task_id(child, parent)  # never a call id


@SERIALIZED
@given(args=ARGS, kwargs=KWARGS)
def test_a_digest_ignores_the_container_and_the_keyword_order(
        args: list[Any], kwargs: dict[str, Any]) -> None:
    digest = call_digest(args, kwargs)
    assert len(digest) == 32 and int(digest, 16) >= 0
    assert call_digest(tuple(args), dict(reversed(list(kwargs.items())))) == digest
    # Through the serializers a producer may use, it is the worker's digest.
    for serializer in ("json", "msgpack", "pickle"):
        assert publish_digest(args, kwargs, serializer) == digest


@SERIALIZED
@given(args=ARGS, kwargs=KWARGS, extra=JSON_VALUES)
def test_other_arguments_are_another_digest(args: list[Any], kwargs: dict[str, Any],
                                            extra: Any) -> None:
    assert call_digest([*args, extra], kwargs) != call_digest(args, kwargs)
    assert call_digest(args, {**kwargs, "\x00extra": extra}) != call_digest(args, kwargs)


def test_values_beyond_json_are_compared_by_type_and_value() -> None:
    day = datetime.date(2030, 1, 2)
    moment = datetime.datetime(2030, 1, 2)
    assert call_digest([day], {}) != call_digest([moment], {}) != call_digest(
        ["2030-01-02"], {})
    assert call_digest([decimal.Decimal("1.5")], {}) != call_digest([1.5], {})
    assert call_digest([b"\x00"], {}) != call_digest(["00"], {})
    assert call_digest([uuid.UUID(int=1)], {}) != call_digest([str(uuid.UUID(int=1))], {})
    # A set compares regardless of its order.
    assert call_digest([{3, 1, 2}], {}) == call_digest([{2, 3, 1}], {})
    assert call_digest([frozenset({"a"})], {}) == call_digest([{"a"}], {})
    assert call_digest([datetime.time(1, 2)], {}) != call_digest(["01:02:00"], {})


def test_a_value_json_cannot_show_is_compared_by_its_pickle() -> None:
    assert call_digest([complex(1, 2)], {}) == call_digest([complex(1, 2)], {})
    assert call_digest([complex(1, 2)], {}) != call_digest([complex(2, 1)], {})
    assert call_digest([float("nan")], {}) == call_digest([float("nan")], {})


def test_an_id_is_non_empty_text_of_bounded_length() -> None:
    assert checked_id("call_1", "call_id") == "call_1"
    assert checked_id("x" * MAX_ID_LENGTH, "call_id")
    for bad, said in ((None, "must be text, not NoneType"), (42, "must be text, not int"),
                      ("", "is empty"), ("x" * (MAX_ID_LENGTH + 1), "is 201 characters long")):
        with pytest.raises(InvalidCallId, match=said):
            checked_id(bad, "call_id")


def test_a_conflict_says_whose_id_it_is() -> None:
    assert conflict_text("t1", "tools.b", "tools.a", "tool") == (
        "task id 't1' belongs to a call of tools.a, not of tools.b: a call id names one "
        "call; give this one its own")
    assert "with other arguments" in conflict_text("t1", "tools.b", "tools.b", "arguments")


# -- an attempt -----------------------------------------------------------------------


def test_a_producer_may_set_only_the_run_call_caller_replay_and_again_headers() -> None:
    assert forged_headers({name: "x" for name in ALLOWED_HEADERS}) == []
    assert forged_headers({"tooleffect_effect": 1, "TOOLEFFECT_token": 2, "Tooleffect_x": 3,
                           "x-tooleffect_y": 4, "traceparent": 5,
                           7: 6}) == [  # type: ignore[dict-item]
        "TOOLEFFECT_token", "Tooleffect_x", "tooleffect_effect"]
    # What the worker hands over to its pool is refused from a producer.
    assert forged_headers({HANDOFF_FIELD: "1", NOTES_FIELD: "1"}) == sorted(
        [HANDOFF_FIELD, NOTES_FIELD])


def test_the_run_is_the_producer_s_header_else_the_root() -> None:
    assert resolve_run_id({RUN_ID_HEADER: "r1", "root_id": "root"}, "t") == "r1"
    assert resolve_run_id({"headers": {RUN_ID_HEADER: "r2"}, "root_id": "root"}, "t") == "r2"
    assert resolve_run_id({"root_id": "root"}, "t") == "root"
    assert resolve_run_id({"headers": "not a mapping"}, "t") == "t"
    assert resolve_run_id({RUN_ID_HEADER: ""}, "t") == "t"


def test_the_queue_is_the_routing_key_else_the_queue_else_the_default() -> None:
    assert queue_name({"routing_key": "rk", "queue": "q"}, "d") == "rk"
    assert queue_name({"queue": "q"}, "d") == "q"
    assert queue_name(None, "d") == queue_name({}, "d") == "d"


@pytest.mark.parametrize(("fields", "info", "retries", "again"), [
    ({}, {}, 0, False),
    ({}, {"redelivered": True}, 0, True),
    ({}, None, 1, True),
    ({AGAIN_HEADER: "1"}, {}, 0, True),
    ({REPLAY_HEADER: "by ops"}, {}, 0, True),
    ({AGAIN_HEADER: ""}, {"redelivered": False}, 0, False),
])
def test_a_delivery_may_not_be_the_first(fields: dict[str, Any], info: dict[str, Any] | None,
                                         retries: int, again: bool) -> None:
    assert delivered_again(fields, info, retries) is again


@PROPERTIES
@given(run=st.text(max_size=30), task=IDS, other=IDS)
def test_an_idempotency_key_is_the_task_s_in_its_run(run: str, task: str, other: str) -> None:
    key = idempotency_key(run, task)
    assert len(key) == 32 and key == idempotency_key(run, task)
    assert (key == idempotency_key(run, other)) is (task == other)


def test_owner_tokens_are_never_repeated_and_change_with_the_process() -> None:
    tokens = [new_token() for _ in range(1000)]
    assert len(set(tokens)) == 1000
    assert len({token[:20] for token in tokens}) == 1  # one random draw per process
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a forked pool child draws its own prefix
        os.write(write, new_token()[:20].encode())
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 64).decode() != tokens[0][:20]


def test_an_attempt_is_built_the_same_from_any_request_s_fields() -> None:
    attempt = Attempt.of(
        {"root_id": "root", "headers": {RUN_ID_HEADER: "run"}}, task_id="t", name="tools.t",
        effect=ToolEffect.IDEMPOTENT_WRITE, delivery_info={"routing_key": "tools",
                                                           "redelivered": True},
        default_queue="celery", token="tok", retries=2)
    assert (attempt.run_id, attempt.queue, attempt.redelivered, attempt.again) == (
        "run", "tools", True, True)
    assert attempt.idempotency_key == idempotency_key("run", "t")
    assert (attempt.ref.run_id, attempt.ref.task_id) == ("run", "t")
    context = attempt.context
    assert (context.run_id, context.task_id, context.tool, context.queue) == (
        "run", "t", "tools.t", "tools")
    assert context.worker.endswith(f":{os.getpid()}")


def test_the_caller_header_is_in_every_event_of_the_attempt() -> None:
    """``tooleffect_caller`` (set by the MCP server): recorded as given in each
    event's ``details.caller``, cut to its limit; nothing when absent or not text."""
    caller = '{"auth":"oauth","sub":"alice"}'
    attempt = Attempt.of(
        {"root_id": "root", "headers": {CALLER_HEADER: caller}}, task_id="t", name="tools.t",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, delivery_info=None, default_queue="celery",
        token="tok")
    assert attempt.caller == caller
    assert attempt.context.event("outcome", "succeeded").details["caller"] == caller
    assert attempt.context.event("intent", "started", caller="x").details["caller"] == caller
    assert caller_of({CALLER_HEADER: "c" * (MAX_CALLER_LENGTH + 5)}) == "c" * MAX_CALLER_LENGTH
    assert caller_of({CALLER_HEADER: 7}) == caller_of({}) == ""
    plain = Attempt.of({"root_id": "root"}, task_id="t", name="tools.t",
                       effect=ToolEffect.READ_ONLY, delivery_info=None,
                       default_queue="celery", token="tok")
    assert "caller" not in plain.context.event("outcome", "succeeded").details
