"""One call, one identity (DESIGN §15, docs/identity.md), with real workers.

- A task id reused for another tool or other arguments is refused when the
  caller publishes it (``CallIdConflict``, one round trip, only for a chosen
  id), and by the worker when a producer did not claim it: a dead letter
  ``call_id_conflict`` under its own id, the first call's result intact.
- ``call_id=`` / ``run_id=``: a call re-sent after the worker died is the same
  call (acknowledged without running, the first result, the same key).
- Tools called in a tool's body (directly, ``.apply()``, ``.delay()``) run
  once when the parent retries, is redelivered after SIGKILL, or is replayed.
- Bad ids and arguments no serializer can encode fail before anything runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import EncodeError

from celery_tooleffect import (
    CallIdConflict,
    DeadLetters,
    InvalidCallId,
    ToolTask,
    call_task_id,
)
from celery_tooleffect.admin.operations import DeadLetterOperations, Outcome
from celery_tooleffect.identity import CALLER_HEADER, call_digest, child_task_id, publish_digest
from celery_tooleffect.store.dead_letter_record import conflict_letter_id
from celery_tooleffect.store.dead_letters import DeadLetterReason
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.worker.attempt import idempotency_key
from tests.apps.identity_app import build
from tests.conftest import REDIS_URL, WorkerProcess, dead_lettering_ended, wait_for

MODULE = "tests.apps.identity_app"


@pytest.fixture
def app(prefix: str, broker_url: str) -> Celery:
    return build(prefix, broker_url=broker_url)


@pytest.fixture
def start(app_workers: Callable[..., WorkerProcess]) -> Callable[..., WorkerProcess]:
    def spawn(**env: str) -> WorkerProcess:
        return app_workers(MODULE, concurrency=2, **env)

    return spawn


@pytest.fixture
def client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


def runs(client: redis.Redis, prefix: str, key: str) -> int:
    return int(client.get(f"{prefix}count:{key}") or 0)


def events_of(app: Celery, run_id: str, task_id: str) -> list[tuple[str, str]]:
    return [(event["phase"], event["status"]) for event in runtime_for(app).audit.events(run_id)
            if event.get("task_id") == task_id]


def crash_env(tmp_path: Path, spec: str) -> dict[str, str]:
    return {"TOOLEFFECT_CRASH_AT": spec, "TOOLEFFECT_CRASH_MARK": str(tmp_path / "crashed")}


# -- a reused task id ------------------------------------------------------------------


def test_a_task_id_reused_for_another_tool_or_other_arguments_is_refused_at_publish(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    niw, iw = app.tasks["ident.niw"], app.tasks["ident.iw"]
    task_id = f"call_{uuid.uuid4().hex[:10]}"
    assert niw.apply_async(("A",), task_id=task_id).get(timeout=30) == "niw:A"

    with pytest.raises(CallIdConflict) as other_tool:
        iw.apply_async(("B",), task_id=task_id)
    assert other_tool.value.recorded_tool == "ident.niw" and other_tool.value.conflict == "tool"
    with pytest.raises(CallIdConflict) as other_args:
        niw.apply_async(("B",), task_id=task_id)
    assert other_args.value.conflict == "arguments"

    # The same call again: acknowledged without running, the first result.
    again = niw.apply_async(("A",), task_id=task_id)
    wait_for(lambda: ("duplicate_ignored", "succeeded") in events_of(app, task_id, task_id),
             what="the duplicate acknowledged")
    assert again.get(timeout=10) == "niw:A"
    assert runs(client, prefix, "A") == 1
    assert runs(client, prefix, "B") == 0
    assert app.AsyncResult(task_id).result == "niw:A"


def test_a_reused_id_nobody_claimed_is_a_dead_letter_and_the_first_result_stays(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    task_id = f"call_{uuid.uuid4().hex[:10]}"
    assert app.tasks["ident.niw"].apply_async(("A",), task_id=task_id).get(timeout=30) == "niw:A"
    # A plain producer (send_task claims nothing): the worker's journal refuses it.
    app.send_task("ident.iw", ("B",), task_id=task_id, queue="tools")
    app.send_task("ident.niw", ("C",), task_id=task_id, queue="tools")
    letters = DeadLetters(app)
    by_tool = wait_for(lambda: letters.get(conflict_letter_id(task_id, call_digest(["B"], {}))),
                       what="the conflict of another tool")
    by_args = wait_for(lambda: letters.get(conflict_letter_id(task_id, call_digest(["C"], {}))),
                       what="the conflict of other arguments")
    assert by_tool.reason == by_args.reason == DeadLetterReason.CALL_ID_CONFLICT.value
    assert by_tool.failure_class == "client_error" and "ident.niw" in by_tool.error
    assert by_tool.message is not None and by_tool.message.headers["id"] == task_id
    assert runs(client, prefix, "B") == runs(client, prefix, "C") == 0
    assert runs(client, prefix, "A") == 1
    # The first call's result and journal are untouched, and no letter of it exists.
    result = app.AsyncResult(task_id)
    assert (result.state, result.result) == ("SUCCESS", "niw:A")
    entry = runtime_for(app).journal.read(JournalRef(task_id, task_id))
    assert (entry["state"], entry["tool"]) == ("succeeded", "ident.niw")
    assert letters.get(task_id) is None
    # A conflict is never replayed: its id is another call's.
    replay = DeadLetterOperations(app).replay(by_tool.task_id, actor="test", reason="x",
                                              force=True)
    assert replay.outcome is Outcome.REFUSED and "another call" in replay.message


def test_a_claim_costs_one_round_trip_only_for_a_chosen_id(
    prefix: str, client: redis.Redis,
) -> None:
    app = build(prefix)
    read = app.tasks["ident.read"]
    claims = f"{prefix}te:call:"
    with client.monitor() as monitor:
        read.apply_async(("free",))  # Celery's own id: no claim
        chosen = read.apply_async(("chosen",), task_id=f"chosen-{uuid.uuid4().hex}")
        marker = f"{prefix}marker"
        client.set(marker, "1")  # the end of what this test sent
        sent = []
        for command in monitor.listen():
            text = str(command["command"])
            if prefix in text and command.get("client_type") != "lua":  # round trips only
                sent.append(text)
            if marker in text:
                break
    claim_commands = [text for text in sent if claims in text]
    assert len(claim_commands) == 1, sent
    assert "EVALSHA" in claim_commands[0] and chosen.id in claim_commands[0]


# -- the agent's own call id -------------------------------------------------------------


def test_a_call_id_resent_after_the_worker_died_is_the_same_call(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
    tmp_path: Path,
) -> None:
    niw = app.tasks["ident.niw"]
    # The worker dies after the outcome is stored, before the acknowledgement.
    start(**crash_env(tmp_path, "before_ack@ident.niw"))
    first = niw.apply_async(("k",), call_id="call_abc", run_id="run-7")
    assert first.id == call_task_id("call_abc", "run-7")
    wait_for(lambda: (tmp_path / "crashed").exists(), what="the worker's crash")
    start()
    # The agent runtime, restarted, sends the same tool call again.
    again = niw.apply_async(("k",), call_id="call_abc", run_id="run-7")
    assert again.id == first.id
    assert again.get(timeout=60) == "niw:k"
    wait_for(lambda: events_of(app, "run-7", first.id).count(
        ("duplicate_ignored", "succeeded")) >= 1, timeout=40, what="the resend acknowledged")
    assert runs(client, prefix, "k") == 1
    seen = [key.decode() for key in client.lrange(f"{prefix}key:k", 0, -1)]
    assert seen == [idempotency_key("run-7", first.id)]
    intent = [event for event in runtime_for(app).audit.events("run-7")
              if event["phase"] == "intent"]
    assert [event["idempotency_key"] for event in intent] == seen


# -- tools called in a tool's body -------------------------------------------------------


def children_ran_once(app: Celery, client: redis.Redis, prefix: str, key: str,
                      parent_id: str) -> None:
    """Each child of ``parent`` ran once, the queued one's repeats acknowledged."""
    queued = {raw.decode() for raw in client.lrange(f"{prefix}children:{key}", 0, -1)}
    assert queued == {child_task_id(parent_id, "ident.charge", "#3")}, queued
    (queued_id,) = queued
    wait_for(lambda: app.AsyncResult(queued_id).state == "SUCCESS", what="the queued child")
    for child in ("direct", "apply", "queued"):
        assert runs(client, prefix, f"{key}-{child}") == 1, child


def test_children_run_once_when_their_parent_retries(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    result = app.tasks["ident.parent"].apply_async(("p", 2))
    direct, applied, queued_id = result.get(timeout=60)
    assert (direct, applied) == ("charged:p-direct", "charged:p-apply")
    assert runs(client, prefix, "p-parent") == 3
    children_ran_once(app, client, prefix, "p", result.id)
    # The two later publishes of the queued child were acknowledged without running.
    wait_for(lambda: events_of(app, result.id, queued_id).count(
        ("duplicate_ignored", "succeeded")) == 2, what="the queued child's repeats")


def test_the_caller_of_a_call_is_in_every_event_of_its_children_and_retries(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    """``tooleffect_caller`` (set by the MCP server): every event of the call,
    of its retry and of each tool its body calls (directly, ``.apply()``,
    ``.delay()``) records it."""
    start()
    caller = '{"auth":"oauth","sub":"alice"}'
    result = app.tasks["ident.parent"].apply_async(("who", 1), headers={CALLER_HEADER: caller})
    _, _, queued_id = result.get(timeout=60)
    wait_for(lambda: app.AsyncResult(queued_id).state == "SUCCESS", what="the queued child")
    events = runtime_for(app).audit.events(result.id)
    tasks = {event.task_id for event in events}
    assert len(tasks) == 4, tasks  # the parent and its three children
    assert {event.details.get("caller") for event in events} == {caller}
    assert ("outcome", "retrying") in [(event.phase, event.status) for event in events]


def test_children_run_once_when_their_parent_is_redelivered_after_sigkill(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    worker = start()
    result = app.tasks["ident.parent"].apply_async(("r",), {"hold_once": True})
    wait_for(lambda: runs(client, prefix, "r-parent") == 1, what="the parent's first run")
    # The queued child ended before the kill (its outcome recorded, not just its
    # body run: a kill between the two interrupts it, and an interrupted
    # NON_IDEMPOTENT_WRITE is dead-lettered, never run again).
    queued_id = child_task_id(result.id, "ident.charge", "#3")
    wait_for(lambda: app.AsyncResult(queued_id).state == "SUCCESS", what="the queued child")
    worker.kill()  # SIGKILL, main process and pool
    client.set(f"{prefix}release:r", "1")
    start()
    direct, applied, _ = result.get(timeout=90)
    assert (direct, applied) == ("charged:r-direct", "charged:r-apply")
    assert runs(client, prefix, "r-parent") == 2
    children_ran_once(app, client, prefix, "r", result.id)


def test_children_run_once_when_their_parent_is_replayed(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    result = app.tasks["ident.parent"].apply_async(("d",), {"refuse_once": True})
    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=30, what="the letter")
    assert letter.reason == DeadLetterReason.NOT_RETRYABLE.value
    dead_lettering_ended(app, result.id)
    replayed = DeadLetterOperations(app).replay(result.id, actor="test", reason="fixed")
    assert replayed.outcome is Outcome.DONE, replayed.message
    # A fresh AsyncResult each time: one caches a ready state (the FAILURE).
    wait_for(lambda: app.AsyncResult(result.id).state == "SUCCESS", timeout=30,
             what="the replayed parent")
    assert runs(client, prefix, "d-parent") == 2
    children_ran_once(app, client, prefix, "d", result.id)


def test_grandchildren_keep_their_ids_when_the_grandparent_retries(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    result = app.tasks["ident.nested"].apply_async(("n", 1))
    assert result.get(timeout=60) == "charged:n-inner-direct"
    assert runs(client, prefix, "n-nested") == 2
    assert runs(client, prefix, "n-inner-parent") == 1  # the child parent ran once
    for child in ("direct", "apply", "queued"):
        wait_for(lambda c=child: runs(client, prefix, f"n-inner-{c}") == 1, what=child)


def test_a_non_idempotent_child_that_raised_is_not_run_again_by_its_retried_parent(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    result = app.tasks["ident.flaky_parent"].apply_async(("f",))
    letter = wait_for(lambda: DeadLetters(app).get(result.id), timeout=30, what="the letter")
    assert runs(client, prefix, "f") == 1  # the child charged once
    assert runs(client, prefix, "f-parent") == 2  # retried once for the child's error
    assert letter.exception_type == "InterruptedWrite" and "may have written" in letter.error


def test_children_with_step_keys_keep_their_ids_in_any_order(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    stepped = app.tasks["ident.stepped"]
    result = stepped.apply_async(("s", ["a", "b"], 1))
    ids = result.get(timeout=60)
    assert ids == [child_task_id(result.id, "ident.charge", "@a"),
                   child_task_id(result.id, "ident.charge", "@b")]
    for step in ("a", "b"):
        wait_for(lambda s=step: app.AsyncResult(child_task_id(
            result.id, "ident.charge", f"@{s}")).state == "SUCCESS", what=step)
        assert runs(client, prefix, f"s-{step}") == 1
    with pytest.raises(InvalidCallId, match="step="):
        app.tasks["ident.charge"].apply_async(("x",), step="outside a body")


# -- bad input ---------------------------------------------------------------------------


@pytest.fixture
def local_app(prefix: str) -> Iterator[Celery]:
    yield build(prefix)


@pytest.mark.parametrize("call_id", [None, 7, "", "x" * 201])
def test_a_call_id_that_cannot_be_one_is_refused_before_publishing(
    local_app: Celery, call_id: Any, client: redis.Redis, prefix: str,
) -> None:
    niw = local_app.tasks["ident.niw"]
    if call_id is None:
        with pytest.raises(InvalidCallId, match="not both"):
            niw.apply_async(("x",), call_id="c", task_id="t")
    else:
        with pytest.raises(InvalidCallId):
            niw.apply_async(("x",), call_id=call_id)
    assert not client.keys(f"{prefix}tools*")  # nothing was published


def test_a_child_whose_arguments_cannot_be_encoded_fails_before_it_runs(
    local_app: Celery, client: redis.Redis, prefix: str,
) -> None:
    charge = local_app.tasks["ident.charge"]

    @local_app.task(base=ToolTask, name="ident.bad_parent", shared=False)
    def bad_parent() -> str:
        return str(charge(object()))

    with pytest.raises(EncodeError):
        bad_parent.apply().get()
    with pytest.raises(EncodeError):
        publish_digest((object(),), {}, "json")
    assert not client.keys(f"{prefix}count:*")  # the child's body never ran
    assert not client.keys(f"{prefix}te:*journal*")  # nothing was recorded


def test_digests_agree_across_serializers() -> None:
    import datetime
    import decimal

    args = ([1, (2, 3)], {"when": datetime.datetime(2026, 12, 4), "price": decimal.Decimal("9.5"),
                          "raw": b"\x00\xff", "id": uuid.UUID(int=1)})
    for serializer in ("json", "msgpack", "pickle", "yaml"):
        simple = ([1, [2, 3]], {"b": "x", "a": 1})
        assert publish_digest(*simple, serializer) == call_digest([1, [2, 3]], {"a": 1, "b": "x"})
    assert publish_digest(*args, "json") == publish_digest(*args, "pickle") == call_digest(*args)
    assert call_digest(["a"], {}) != call_digest(["b"], {})
