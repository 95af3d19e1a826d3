"""Every way Celery itself re-runs or ends a task keeps the tool's effect promise.

Real ``celery worker`` subprocesses run the tools of tests/apps/paths_app.py:
``autoretry_for`` (refused on a NON_IDEMPOTENT_WRITE, one budget elsewhere),
``self.retry()`` on each effect, ``revoke(terminate=True)`` with the default
signal and with SIGKILL, revoke before start, ``expires`` (before the first
run and while a retry waits), and tool classes that subclass a tool (solo
pool: one process runs both). Each test asserts how many times a body ran,
where the task ended, and what the journal and audit hold.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import AuditEvent, DeadLetters
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.lua import script
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import Ending, JournalState
from celery_tooleffect.worker.handoff import HANDOFF_FIELD, NOTES_FIELD
from tests.apps.paths_app import build
from tests.conftest import REDIS_URL, WorkerProcess, wait_for
from tests.support import Monitor

EFFECTS = ("read_only", "idempotent_write", "non_idempotent_write")
SCRIPT_NAMES = {script(name).sha: name for name in ("begin_attempt", "transition")}


@pytest.fixture
def start(app_workers: Callable[..., WorkerProcess]) -> Callable[..., WorkerProcess]:
    def spawn(pool: str = "prefork", wait: bool = True, **env: str) -> WorkerProcess:
        return app_workers("tests.apps.paths_app", pool=pool,
                           concurrency=2 if pool == "prefork" else 1, wait=wait, **env)

    return spawn


@pytest.fixture
def app(prefix: str, broker_url: str) -> Celery:
    return build(prefix, broker_url=broker_url)


@pytest.fixture
def client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


def runs(client: redis.Redis, prefix: str, key: str) -> int:
    return int(client.get(f"{prefix}count:{key}") or 0)


def state_of(app: Celery, task_id: str) -> str:
    return str(app.AsyncResult(task_id).state)


def journal_of(app: Celery, task_id: str) -> dict[str, str]:
    return runtime_for(app).journal.read(JournalRef(task_id, task_id))


def journal_ends(app: Celery, task_id: str, state: str) -> dict[str, str]:
    """The journal entry once it is in ``state``: the worker ends the record
    (e.g. ``dead_lettering`` -> ``dead_lettered``) a moment after what the test
    waited for (the dead letter, the result) is stored, and on a busy machine
    (tests side by side under pytest-xdist) a read can fall in that moment."""
    return wait_for(lambda: (entry := journal_of(app, task_id)).get("state") == state and entry,
                    what=f"journal state {state} of {task_id}")


def events_of(app: Celery, task_id: str) -> list[dict[str, str]]:
    return [event for event in runtime_for(app).audit.events(task_id)
            if event.get("task_id") == task_id]


def phases(app: Celery, task_id: str) -> list[tuple[str, str]]:
    return [(event["phase"], event["status"]) for event in events_of(app, task_id)]


def letter_of(app: Celery, task_id: str, timeout: float = 20.0) -> DeadLetter:
    return wait_for(lambda: DeadLetters(app).get(task_id), timeout=timeout,
                    what=f"dead letter {task_id}")


def send(app: Celery, name: str, *args: Any, **options: Any) -> str:
    task_id = uuid.uuid4().hex
    app.send_task(name, args, task_id=task_id, queue="tools", **options)
    return task_id


# -- autoretry_for -------------------------------------------------------------------


def test_autoretry_on_a_non_idempotent_write_is_refused_and_the_worker_does_not_start(
    start: Callable[..., WorkerProcess], prefix: str,
) -> None:
    worker = start(wait=False, TE_REFUSED="1")
    wait_for(lambda: worker.process.poll() is not None, timeout=30, what="worker to stop")
    output = worker.output()
    assert worker.process.returncode != 0
    assert "ToolDeclarationError" in output
    assert "paths.refused: autoretry_for=(ConnectionError) is refused on a " \
           "NON_IDEMPOTENT_WRITE" in output
    assert "NoSideEffect" in output and "IDEMPOTENT_WRITE" in output
    assert "self.retry()" in output


def test_autoretry_with_backoff_retries_an_idempotent_write_until_it_succeeds(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    task_id = send(app, "paths.flaky_write", "flaky", 2)
    wait_for(lambda: state_of(app, task_id) == "SUCCESS", what="the write to succeed")
    assert app.AsyncResult(task_id).result == 3
    assert runs(client, prefix, "flaky") == 3
    journal = journal_of(app, task_id)
    assert journal["state"] == "succeeded" and journal["attempt"] == "3"
    assert journal[Ending.FAILED.counter] == "2"
    retrying = [event for event in events_of(app, task_id) if event["status"] == "retrying"]
    assert len(retrying) == 2
    # Celery's retry_backoff with retry_backoff_max=1 and full jitter: 0 <= countdown <= 1.
    assert all(0 <= float(event["countdown"]) <= 1 for event in retrying)
    assert all(event["exception_type"] == "ConnectionError" for event in retrying)
    assert DeadLetters(app).get(task_id) is None


def test_retry_state_is_stored_before_the_retry_can_begin(
    app: Celery, start: Callable[..., WorkerProcess],
) -> None:
    """Celery publishes a retry before its tracer stores RETRY, and its guard
    against overwriting a SUCCESS is a GET then a SET: a retry whose countdown
    jitter made 0 could begin, run and store SUCCESS in between, leaving the
    call RETRY forever (seen under CI load). The worker stores RETRY inside
    each attempt, before the journal lets the retry begin, and the tracer
    does not store it again."""
    start()
    task_id = uuid.uuid4().hex
    stored = re.compile(r'status\W+(RETRY|SUCCESS)')
    with Monitor(redis.Redis.from_url(REDIS_URL)) as monitor:
        app.send_task("paths.flaky_write", ("jitter", 2), task_id=task_id, queue="tools")
        wait_for(lambda: state_of(app, task_id) == "SUCCESS", what="the write to succeed")
    steps = []
    for command in list(monitor.received):
        words = command["command"].split(" ")
        if task_id not in command["command"]:
            continue
        if words[0].upper() == "EVALSHA" and words[1] in SCRIPT_NAMES:
            steps.append(SCRIPT_NAMES[words[1]])
        elif words[0].upper() in ("SET", "SETEX") and "celery-task-meta" in words[1]:
            match = stored.search(command["command"])
            assert match is not None, command
            steps.append(match.group(1))
    assert steps == ["begin_attempt", "RETRY", "transition"] * 2 + [
        "begin_attempt", "transition", "SUCCESS"], steps


def test_autoretry_spends_the_tool_budget_then_dead_letters_retries_exhausted(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    task_id = send(app, "paths.always_flaky", "always")
    letter = letter_of(app, task_id)
    # max_retries=1 on the tool: the first run and one retry.
    assert runs(client, prefix, "always") == 2
    assert letter.reason == "retries_exhausted"
    assert letter.exception_type == "ConnectionError"
    assert letter.attempts == 2
    assert "interrupted" not in letter.error
    journal_ends(app, task_id, "dead_lettered")


def test_autoretry_for_retries_what_it_lists_and_never_what_dont_autoretry_for_lists(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    # ValueError is a client error to the classifier (not retried), but the
    # tool lists it in autoretry_for.
    retried = send(app, "paths.read_autoretry", "value", 1)
    refused = send(app, "paths.read_autoretry", "key", 1, "key")
    wait_for(lambda: state_of(app, retried) == "SUCCESS", what="the read to succeed")
    assert runs(client, prefix, "value") == 2
    letter = letter_of(app, refused)
    assert runs(client, prefix, "key") == 1
    assert letter.reason == "not_retryable" and letter.exception_type == "KeyError"


# -- self.retry() ----------------------------------------------------------------------


@pytest.mark.parametrize("effect", EFFECTS)
def test_a_retry_the_tool_asks_for_is_honoured_and_audited_for_every_effect(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
    effect: str,
) -> None:
    start()
    task_id = send(app, f"paths.requested_{effect}", "asked", 1)
    wait_for(lambda: state_of(app, task_id) == "SUCCESS", what="the tool to succeed")
    assert runs(client, prefix, "asked") == 2
    requested = [event for event in events_of(app, task_id)
                 if (event["phase"], event["status"]) == ("outcome", "retrying")]
    assert len(requested) == 1
    assert requested[0]["requested"] == "1" and requested[0]["countdown"] == "0.1"
    if effect != "read_only":
        journal = journal_of(app, task_id)
        assert journal["state"] == "succeeded" and journal["attempt"] == "2"
        assert journal[Ending.REQUESTED.counter] == "1"
    assert DeadLetters(app).get(task_id) is None


def test_a_retried_tool_reads_the_callers_custom_headers_and_nothing_of_the_worker(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    """``self.request.headers`` holds the producer's custom headers on every
    attempt (a retry carries them on), and nothing the worker's main process
    handed its pool: the body can return it (the result backend serializes it)."""
    start()
    task_id = send(app, "paths.retried_headers", "headers",
                   headers={"x-test-header": "test-value"})
    wait_for(lambda: state_of(app, task_id) == "SUCCESS", what="the retried tool to succeed")
    headers = app.AsyncResult(task_id).result
    assert runs(client, prefix, "headers") == 2
    assert headers["x-test-header"] == "test-value"
    assert HANDOFF_FIELD not in headers and NOTES_FIELD not in headers


def test_requested_retries_that_spend_the_budget_say_so_in_the_dead_letter(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    task_id = send(app, "paths.requested_non_idempotent_write", "forever", 100)
    letter = letter_of(app, task_id)
    # tooleffect_max_retries=2: the first run and two requested retries.
    assert runs(client, prefix, "forever") == 3
    assert letter.reason == "retries_exhausted"
    assert letter.exception_type == "RetriesExhausted"
    assert "asked for a retry (self.retry()) after 2 retries" in letter.error
    assert "retry budget of 2 is spent" in letter.error
    assert "ConnectionError: forever: not yet" in letter.error
    assert "interrupted" not in letter.error
    assert journal_of(app, task_id)[Ending.REQUESTED.counter] == "2"


# -- revoke -------------------------------------------------------------------------


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_a_write_terminated_by_revoke_is_a_dead_letter_and_never_runs_again(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
    signame: str,
) -> None:
    first = start()
    key = f"revoked-{signame}"
    task_id = send(app, "paths.hold_non_idempotent_write", key)
    wait_for(lambda: runs(client, prefix, key) == 1, what="the write to start")
    app.control.revoke(task_id, terminate=True, signal=signame)
    letter = letter_of(app, task_id, timeout=10)
    assert letter.reason == "revoked"
    assert letter.exception_type == "TaskRevokedWhileRunning"
    assert f"signal {int(getattr(signal, signame))}" in letter.error
    assert letter.message is not None  # the message as delivered, kept for an operator
    wait_for(lambda: state_of(app, task_id) == "REVOKED", what="state REVOKED")
    journal_ends(app, task_id, "dead_lettered")
    assert ("outcome", "revoked") in phases(app, task_id)
    assert ("dead_lettered", "revoked") in phases(app, task_id)

    # The same message delivered again to a worker that never heard of the
    # revoke is acknowledged without running.
    first.kill()
    start()
    app.send_task("paths.hold_non_idempotent_write", (key,), task_id=task_id, queue="tools")
    wait_for(lambda: ("duplicate_ignored", "dead_lettered") in phases(app, task_id),
             what="the second delivery to be ignored")
    client.set(f"{prefix}release:{key}", 1)
    assert runs(client, prefix, key) == 1


def test_a_read_terminated_by_revoke_is_audited_and_not_dead_lettered(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    task_id = send(app, "paths.hold_read_only", "read")
    wait_for(lambda: runs(client, prefix, "read") == 1, what="the read to start")
    app.control.revoke(task_id, terminate=True)
    wait_for(lambda: ("outcome", "revoked") in phases(app, task_id), what="revoked outcome")
    wait_for(lambda: state_of(app, task_id) == "REVOKED", what="state REVOKED")
    assert DeadLetters(app).get(task_id) is None
    assert runs(client, prefix, "read") == 1


@pytest.mark.parametrize("effect", EFFECTS)
def test_a_task_revoked_before_it_starts_ends_without_running(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
    effect: str,
) -> None:
    start()
    # A revoke is a broadcast: on Redis, kombu's fanout is pub/sub, and a
    # worker that is ready but has not yet subscribed its pidbox never hears
    # it (seen in loaded CI runs: the task then ran at its ETA). Once the
    # worker answers a ping it hears broadcasts.
    wait_for(lambda: app.control.ping(timeout=0.5), what="the worker to answer a ping")
    key = f"early-{effect}"
    task_id = send(app, f"paths.hold_{effect}", key, countdown=2)
    app.control.revoke(task_id)
    wait_for(lambda: state_of(app, task_id) == "REVOKED", what="state REVOKED")
    wait_for(lambda: ("outcome", "not_run") in phases(app, task_id), what="not_run outcome")
    not_run = next(event for event in events_of(app, task_id) if event["status"] == "not_run")
    assert not_run["cause"] == "revoked"
    if effect != "read_only":
        assert journal_of(app, task_id)["state"] == "not_run"
    assert runs(client, prefix, key) == 0
    assert DeadLetters(app).get(task_id) is None


# -- expires ------------------------------------------------------------------------


def test_a_task_that_expired_before_it_was_delivered_ends_without_running(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
    broker_url: str,
) -> None:
    task_id = send(app, "paths.hold_non_idempotent_write", "stale",
                   expires=datetime.now(timezone.utc) - timedelta(seconds=1))
    start()
    if broker_url.startswith("amqp"):
        # Celery gives the message a TTL from ``expires`` (0 when past): RabbitMQ
        # drops it itself, and no worker ever sees it. Nothing ran, nothing is
        # journalled; the queue is empty.
        def queued() -> int:
            with app.connection_for_write() as connection:
                declared = connection.default_channel.queue_declare("tools", passive=True)
                return int(declared.message_count)

        wait_for(lambda: queued() == 0, what="RabbitMQ to drop the expired message")
        assert journal_of(app, task_id) == {} and events_of(app, task_id) == []
        assert state_of(app, task_id) == "PENDING"
    else:
        wait_for(lambda: state_of(app, task_id) == "REVOKED", what="state REVOKED")
        journal = journal_of(app, task_id)
        assert journal["state"] == "not_run" and journal["cause"] == "expired"
        assert ("outcome", "not_run") in phases(app, task_id)
    assert runs(client, prefix, "stale") == 0
    assert DeadLetters(app).get(task_id) is None


def test_a_retry_that_expires_while_it_waits_ends_without_running_again(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start()
    # The first run asks for a retry in 3 s; the task expires in 1.5 s.
    task_id = send(app, "paths.retry_then_wait", "waits", 3.0,
                   expires=datetime.now(timezone.utc) + timedelta(seconds=1.5))
    wait_for(lambda: state_of(app, task_id) == "REVOKED", timeout=30, what="state REVOKED")
    journal = journal_of(app, task_id)
    assert journal["state"] == "not_run" and journal["cause"] == "expired"
    assert [phase for phase in phases(app, task_id) if phase[0] == "outcome"] == [
        ("outcome", "retrying"), ("outcome", "not_run")]
    assert runs(client, prefix, "waits") == 1
    assert DeadLetters(app).get(task_id) is None


# -- tool classes ------------------------------------------------------------------


def test_a_tool_subclass_keeps_its_own_signature_effect_and_budget_in_one_process(
    app: Celery, start: Callable[..., WorkerProcess], client: redis.Redis, prefix: str,
) -> None:
    start(pool="solo")
    calls = [
        ("paths.charge", (5,)), ("paths.charge_in_currency", (5, "EUR")),
        ("paths.quote", ("tea",)), ("paths.quote_and_reserve", ("tea", "friday")),
        ("paths.charge", (6,)), ("paths.charge_in_currency", (6, "USD")),
    ]
    ids = []
    for name, args in calls:
        ids.append(send(app, name, *args))
        # One at a time: the parent has run in the process before its subclass runs.
        wait_for(lambda: state_of(app, ids[-1]) in ("SUCCESS", "FAILURE"), what=name)
    assert [app.AsyncResult(task_id).result for task_id in ids] == [
        "charged:5", "charged:5:EUR", "quote:tea", "reserved:tea:friday",
        "charged:6", "charged:6:USD",
    ]
    effects = {name: events_of(app, task_id)[0]["effect"]
               for (name, _), task_id in zip(calls, ids, strict=True)}
    assert effects == {
        "paths.charge": "non_idempotent_write",
        "paths.charge_in_currency": "idempotent_write",
        "paths.quote": "read_only",
        "paths.quote_and_reserve": "idempotent_write",
    }
    assert [runs(client, prefix, key) for key in
            ("charge", "charge_in_currency", "quote", "quote_and_reserve")] == [2, 2, 1, 1]
    assert not any(DeadLetters(app).get(task_id) for task_id in ids)


def test_the_journal_says_what_spent_the_budget(app: Celery) -> None:
    """Three attempts end three different ways; the fourth finds the budget spent."""
    journal = runtime_for(app).journal
    task_id = uuid.uuid4().hex
    ref = JournalRef(task_id, task_id)
    event = AuditEvent.of(run_id=task_id, task_id=task_id, tool="paths.t",
                          effect="idempotent_write", phase="intent", status="started",
                          worker="test:1", queue="tools")
    endings = [(Ending.FAILED, "retry_scheduled"), (Ending.REQUESTED, "retry_scheduled")]
    for token, (ending, state) in zip(("a", "b"), endings, strict=True):
        begin = journal.begin_attempt(ref, token=token, effect="idempotent_write",
                                      lease_end=time.time() + 60, attempts_allowed=3,
                                      event=event)
        assert begin.verdict.value == "started"
        assert journal.transition(ref, new_state=JournalState(state),
                                  allowed=frozenset({JournalState.RUNNING}), token=token,
                                  event=event.amended(phase="outcome"), ending=ending)
    # The third attempt's owner dies: its lease lapses (the lease end is in the past).
    journal.begin_attempt(ref, token="c", effect="idempotent_write",
                          lease_end=time.time() - 1, attempts_allowed=3, event=event)
    spent = journal.begin_attempt(ref, token="d", effect="idempotent_write",
                                  lease_end=time.time() + 60, attempts_allowed=3, event=event)
    assert spent.verdict.value == "exhausted" and spent.attempt == 3
    assert spent.endings == {Ending.FAILED: 1, Ending.INTERRUPTED: 1, Ending.REQUESTED: 1}
