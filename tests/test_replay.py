"""A dead letter keeps the message as it was delivered; a replay publishes it again.

Real ``celery worker`` subprocesses (prefork: the tool decides the dead letter
in a pool process, the worker's main process stores it with the message) run
the tools of tests/apps/replay_app.py on the test's Redis. Each test asserts
what ran how many times, what the body received, and what the message held.
"""

from __future__ import annotations

import datetime
import decimal
import pickle
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord

from celery_tooleffect import DeadLetters
from celery_tooleffect.admin.operations import DeadLetterOperations, Outcome
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.envelope import REPLAY_HEADER
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import JournalState
from tests.apps.replay_app import build
from tests.conftest import REDIS_URL, WorkerProcess, wait_for

#: Headers a replay changes (everything else is kept as delivered).
CHANGED = {"retries", "eta", "expires", REPLAY_HEADER}


@pytest.fixture
def start(app_workers: Callable[..., WorkerProcess]) -> Callable[..., WorkerProcess]:
    """``celery -A tests.apps.replay_app worker`` subprocesses (prefork, 3 children)."""

    def spawn(**env: str) -> WorkerProcess:
        return app_workers("tests.apps.replay_app", concurrency=3, **env)

    return spawn


@pytest.fixture
def app(prefix: str, broker_url: str) -> Celery:
    return build(prefix, broker_url=broker_url)


@pytest.fixture
def client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


def count(client: redis.Redis, prefix: str, key: str) -> int:
    return int(client.get(f"{prefix}count:{key}") or 0)


def letter_of(app: Celery, task_id: str) -> DeadLetter:
    return wait_for(lambda: DeadLetters(app).get(task_id), what=f"dead letter {task_id}")


def dead_lettering_ended(app: Celery, task_id: str) -> None:
    """Wait until the worker has ended the dead letter's record: it stores the
    letter (what the tests wait for) a moment before it moves the journal from
    ``dead_lettering`` to ``dead_lettered`` (worker/letters.py). A replay in that
    moment is allowed and fences that worker, whose end is then recorded as a
    ``late_outcome``, after which a NON_IDEMPOTENT_WRITE is not replayed again,
    and a chord member's failure may still reach its chord. A busy machine (the
    tests side by side under pytest-xdist) makes that moment long enough."""
    letter = DeadLetters(app).get(task_id)
    ref = JournalRef(letter.run_id or task_id if letter else task_id, task_id)
    journal = runtime_for(app).journal
    wait_for(lambda: journal.read(ref).get("state") != JournalState.DEAD_LETTERING,
             what=f"the journal of {task_id} to leave dead_lettering")


def replay(app: Celery, task_id: str, *, force: bool = True) -> None:
    dead_lettering_ended(app, task_id)
    result = DeadLetterOperations(app).replay(
        task_id, actor="test", reason="provider fixed" if force else "", force=force,
    )
    assert result.outcome is Outcome.DONE, result.message


def state_of(app: Celery, task_id: str) -> str:
    # A fresh AsyncResult each time: one that saw a ready state keeps it.
    return str(app.AsyncResult(task_id).state)


def assert_same_message(first: DeadLetter, second: DeadLetter) -> None:
    """``second`` holds ``first``'s message as a replay publishes it."""
    assert first.message is not None and second.message is not None
    assert second.message.body == first.message.body
    assert second.message.content_type == first.message.content_type
    assert second.message.content_encoding == first.message.content_encoding
    kept = {name: value for name, value in first.message.headers.items() if name not in CHANGED}
    assert {name: value for name, value in second.message.headers.items()
            if name not in CHANGED} == kept
    assert second.message.headers["retries"] == 0
    assert second.message.headers["eta"] is None and second.message.headers["expires"] is None
    assert second.message.headers[REPLAY_HEADER].endswith(" test")
    assert second.message.properties == first.message.properties
    assert (second.message.exchange, second.message.routing_key) == (
        first.message.exchange, first.message.routing_key)


# -- workflows continue ----------------------------------------------------------------


def test_replayed_chain_link_lets_the_rest_of_the_chain_run_once(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    client.set(f"{prefix}fail:create_ticket", 1)
    start()
    workflow = chain(app.signature("replay.search", ("q",)),
                     app.signature("replay.create_ticket"),
                     app.signature("replay.notify")).apply_async()
    middle = workflow.parent.id
    letter = letter_of(app, middle)
    assert letter.message is not None and letter.message.headers["task"] == "replay.create_ticket"
    # Celery marks the rest of a chain failed when a link fails.
    wait_for(lambda: state_of(app, workflow.id) == "FAILURE", what="last link FAILURE")
    assert count(client, prefix, "notify") == 0

    client.delete(f"{prefix}fail:create_ticket")
    replay(app, middle)
    # The last link says FAILURE (propagated) until it runs.
    wait_for(lambda: state_of(app, workflow.id) == "SUCCESS", what="last link SUCCESS")
    assert app.AsyncResult(workflow.id).result == "notified:ticket:found:q"
    assert state_of(app, middle) == "SUCCESS"
    assert count(client, prefix, "search") == 1
    assert count(client, prefix, "create_ticket") == 2  # the failed run and the replay
    assert count(client, prefix, "notify") == 1
    assert DeadLetters(app).get(middle) is None


def test_replay_runs_link_callbacks_and_the_dead_letter_ran_link_error(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    client.set(f"{prefix}fail:create_ticket", 1)
    start()
    result = app.signature("replay.create_ticket", ("x",)).apply_async(
        link=app.signature("replay.on_success"), link_error=app.signature("replay.on_error"),
    )
    letter_of(app, result.id)
    wait_for(lambda: count(client, prefix, "on_error") == 1, what="link_error ran")
    assert count(client, prefix, "on_success") == 0

    client.delete(f"{prefix}fail:create_ticket")
    replay(app, result.id)
    wait_for(lambda: count(client, prefix, "on_success") == 1, what="link ran after replay")
    assert state_of(app, result.id) == "SUCCESS"
    assert count(client, prefix, "on_error") == 1
    assert count(client, prefix, "create_ticket") == 2


def test_chord_member_replayed_while_its_chord_waits_completes_the_chord_once(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    client.set(f"{prefix}fail:member:b", 1)
    client.set(f"{prefix}hold:c", 1)  # member c holds the chord open
    start()
    members = [app.signature("replay.member", (key,)) for key in "abc"]
    result = chord(members)(app.signature("replay.collect"))
    group_ids = [child.id for child in result.parent.results]
    letter = letter_of(app, group_ids[1])
    wait_for(lambda: count(client, prefix, "member:c") == 1, what="member c to start")

    detail = DeadLetterOperations(app).detail(letter.task_id)
    assert detail is not None and detail["replay"]["allowed"], detail["replay"]
    client.delete(f"{prefix}fail:member:b")
    replay(app, letter.task_id, force=False)
    wait_for(lambda: state_of(app, group_ids[1]) == "SUCCESS", what="member b to succeed")
    assert count(client, prefix, "collect") == 0  # c still runs

    client.delete(f"{prefix}hold:c")
    assert result.get(timeout=30) == ["a", "b", "c"]
    assert count(client, prefix, "collect") == 1
    assert count(client, prefix, "member:b") == 2


def test_chord_member_replay_is_refused_once_its_chord_has_ended(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    client.set(f"{prefix}fail:member:b", 1)
    start()
    members = [app.signature("replay.member", (key,)) for key in "abc"]
    result = chord(members)(app.signature("replay.collect"))
    member_b = result.parent.results[1].id
    letter_of(app, member_b)
    wait_for(lambda: state_of(app, result.id) == "FAILURE", what="the chord to fail")
    client.delete(f"{prefix}fail:member:b")

    refused = DeadLetterOperations(app).replay(member_b, actor="test", reason="x", force=True)
    assert refused.outcome is Outcome.REFUSED
    assert "has already ended" in refused.message and "ChordError" in refused.message
    detail = DeadLetterOperations(app).detail(member_b)
    assert detail is not None and not detail["replay"]["allowed"]
    assert "has already ended" in detail["replay"]["refusal"]
    assert DeadLetters(app).get(member_b) is not None  # the letter stays
    assert count(client, prefix, "member:b") == 1
    assert count(client, prefix, "collect") == 0


# -- the message is kept and published again byte for byte ------------------------------


TYPED_ARGS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    # kombu's JSON carries datetime, Decimal, UUID and bytes with type tags.
    "json": ((datetime.datetime(2026, 12, 2, 9, 30, tzinfo=datetime.timezone.utc),
              decimal.Decimal("12.50"), uuid.UUID(int=7), b"\x00\xffraw"),
             {"when": datetime.date(2026, 12, 2), "amount": decimal.Decimal("0.10"),
              "blob": b"\x80"}),
    "msgpack": ((b"\x00\xffraw", 12, "text", [1, 2]), {"blob": b"\x80", "n": -1.5}),
    "yaml": ((datetime.datetime(2026, 12, 2, 9, 30), datetime.date(2026, 12, 2), "x"),
             {"blob": b"\x80", "n": 3}),
    "pickle": ((decimal.Decimal("12.50"), uuid.UUID(int=7), (1, 2), frozenset({3})),
               {"when": datetime.datetime(2026, 12, 2, 9, 30), "blob": b"\x00\xff"}),
}


@pytest.mark.parametrize(
    ("serializer", "compression"),
    [("json", None), ("msgpack", None), ("yaml", None), ("pickle", None), ("json", "gzip")],
    ids=["json", "msgpack", "yaml", "pickle", "json-gzip"],
)
def test_forced_replay_hands_the_body_equal_values_of_the_same_types(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
    serializer: str, compression: str | None,
) -> None:
    args, kwargs = TYPED_ARGS[serializer]
    client.set(f"{prefix}fail:typed", 1)
    start()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    result = app.signature("replay.typed", args, kwargs).apply_async(
        serializer=serializer, compression=compression,
        headers={"x_agent_note": "from-agent-7", "traceparent": traceparent},
    )
    first = letter_of(app, result.id)
    assert first.message is not None
    if compression:
        assert first.message.headers["compression"] == "application/x-gzip"

    # Replayed while the provider still refuses: the second letter holds the
    # message the replay published.
    DeadLetters(app).client.delete(f"{prefix}typed:{result.id}")
    replay(app, result.id)
    wait_for(lambda: client.llen(f"{prefix}typed:{result.id}") == 1, what="replayed run")
    second = wait_for(lambda: (letter := DeadLetters(app).get(result.id)) and
                      letter.dead_lettered_at > first.dead_lettered_at and letter,
                      what="second dead letter")
    assert_same_message(first, second)

    client.delete(f"{prefix}fail:typed")
    replay(app, result.id)
    wait_for(lambda: state_of(app, result.id) == "SUCCESS", what="replay to succeed")
    runs = [pickle.loads(raw) for raw in client.lrange(f"{prefix}typed:{result.id}", 0, -1)]
    assert len(runs) == 2
    for seen in runs:
        assert seen["args"] == args
        assert [type(value) for value in seen["args"]] == [type(value) for value in args]
        assert seen["kwargs"] == kwargs
        assert {key: type(value) for key, value in seen["kwargs"].items()} == {
            key: type(value) for key, value in kwargs.items()}
        assert seen["x_agent_note"] == "from-agent-7"
        assert seen["traceparent"] == traceparent
        assert seen["retries"] == 0
    assert count(client, prefix, "typed") == 3


def test_what_operators_see_is_decoded_and_marked_never_written_back(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    args, kwargs = TYPED_ARGS["json"]
    client.set(f"{prefix}fail:typed", 1)
    start()
    result = app.signature("replay.typed", args, kwargs).apply_async(serializer="json")
    letter = letter_of(app, result.id)
    stored = DeadLetters(app).client.hget(
        DeadLetters(app).keys.dead_letters(letter.queue), result.id)

    detail = DeadLetterOperations(app).detail(result.id)
    assert detail is not None
    shown = detail["dead_letter"]
    assert shown["args"][1] == {"$text": "Decimal('12.50')", "$type": "decimal.Decimal"}
    assert shown["args"][2]["$type"] == "uuid.UUID"
    assert shown["kwargs"]["blob"] == {"$text": "b'\\x80'", "$type": "builtins.bytes"}
    assert shown["message"]["headers"]["task"] == "replay.typed"
    assert shown["decode_error"] is None
    # Showing it changed nothing stored.
    assert DeadLetters(app).client.hget(
        DeadLetters(app).keys.dead_letters(letter.queue), result.id) == stored


# -- messages refused by the consumer -----------------------------------------------------


def test_unknown_task_keeps_its_bytes_and_replays_unchanged_once_the_task_exists(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    without = start(TE_WITHOUT_LATE="1")
    args = (decimal.Decimal("9.99"), b"\x01\x02")
    result = app.signature("replay.late", args, {"note": "n"}).apply_async(
        serializer="json", headers={"x_agent_note": "kept"})
    letter = letter_of(app, result.id)
    assert letter.reason == "unknown_task" and letter.message is not None
    assert letter.message.headers["x_agent_note"] == "kept"
    without.stop()

    start()
    replay(app, result.id)  # an unknown name was NON_IDEMPOTENT_WRITE: forced
    wait_for(lambda: client.llen(f"{prefix}late") == 1, what="the late task to run")
    assert pickle.loads(client.lindex(f"{prefix}late", 0)) == (args, {"note": "n"})
    assert count(client, prefix, "late") == 1


def test_body_of_a_content_type_not_accepted_replays_unchanged_once_accepted(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    json_only = start(TE_ACCEPT="json")
    args = (datetime.date(2026, 12, 2), "x")
    result = app.signature("replay.late", args, {}).apply_async(serializer="yaml")
    letter = letter_of(app, result.id)
    assert letter.reason == "undecodable_message" and letter.message is not None
    assert letter.message.content_type == "application/x-yaml"
    json_only.stop()

    start()
    replay(app, result.id, force=False)  # replay.late is READ_ONLY
    wait_for(lambda: client.llen(f"{prefix}late") == 1, what="the late task to run")
    assert pickle.loads(client.lindex(f"{prefix}late", 0)) == (args, {})


# -- letters of envelope version 1 ---------------------------------------------------------


#: A dead letter as development builds stored it (envelope version 1: no message
#: kept; no release wrote one).
VERSION_1 = (
    '{"task_id": "%(id)s", "name": "replay.late", "queue": "tools", '
    '"reason": "not_retryable", "failure_class": "unknown", "effect": "read_only", '
    '"args": ["old", 1], "kwargs": {"flag": true}, '
    '"headers": {"tooleffect_run_id": "run-%(id)s"}, '
    '"options": {"root_id": "%(id)s", "parent_id": null, "retries": 2, "priority": null, '
    '"exchange": "", "routing_key": "tools"}, "run_id": "run-%(id)s", '
    '"exception_type": "ValueError", "error": "boom", "attempts": 1, "worker": "w@h:1", '
    '"body_completed": false, "dead_lettered_at": 1764600000.0, "raw_body": null, '
    '"raw_body_encoding": null, "content_type": null, "content_encoding": null, '
    '"late_outcomes": []}'
)


def test_a_letter_of_envelope_version_1_is_shown_refused_and_purged(app: Celery) -> None:
    task_id = uuid.uuid4().hex
    old = DeadLetter.from_json(VERSION_1 % {"id": task_id})
    assert old.version == 1 and old.message is None
    assert DeadLetters(app).store(old)
    again = DeadLetters(app).get(task_id)
    assert again is not None and again.to_dict() == old.to_dict()
    assert (again.args, again.kwargs) == ([], {})  # no message: nothing to decode

    operations = DeadLetterOperations(app)
    detail = operations.detail(task_id)
    assert detail is not None and not detail["replay"]["allowed"]
    assert "envelope version 1" in detail["dead_letter"]["decode_error"]
    refused = operations.replay(task_id, actor="test", force=True, reason="old letter")
    assert refused.outcome is Outcome.REFUSED
    assert "keeps no message (envelope version 1" in refused.message
    assert operations.purge(task_id, actor="test", reason="old letter").ok
    assert DeadLetters(app).get(task_id) is None
