"""Privacy: what the audit log and the dead-letter listing say about a call.

At the default level (``metadata``) no argument, result or exception message
may reach the audit log (run streams, the global stream), the journal, the
dead-letter indexes or a dead-letter listing (``dlq list``, the Flower list
and its JSON API, which all use ``letter_summary``). The test passes a secret
as an argument, in a result and in exception messages, through every way a
call can end, then reads every key the package wrote and greps for it.

The dead-letter envelope keeps the arguments and the error verbatim because a
replay needs them (see the README, "Privacy: who can read what"): the test
checks that they are there, and nowhere else in the package's keys.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import AuditLog, ToolEffect, ToolTask
from celery_tooleffect.admin.operations import DeadLetterOperations, letter_summary
from celery_tooleffect.store.dead_letters import DeadLetters
from tests.conftest import running_worker, wait_for
from tests.test_bad_messages import broker_is_empty, publish

SECRET = "sk-live-4111111111111111"
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def key_values(client: redis.Redis, key: bytes) -> bytes:
    """Every name and value ``key`` holds, whatever its type, as one blob."""
    kind = client.type(key)
    if kind == b"stream":
        return b" ".join(b" ".join(k + b" " + v for k, v in fields.items())
                         for _, fields in client.xrange(key))
    if kind == b"hash":
        return b" ".join(k + b" " + v for k, v in client.hgetall(key).items())
    if kind == b"set":
        return b" ".join(client.smembers(key))
    if kind == b"zset":
        return b" ".join(client.zrange(key, 0, -1))
    if kind == b"list":
        return b" ".join(client.lrange(key, 0, -1))
    if kind == b"string":
        return client.get(key) or b""
    return b""


def keys_holding(client: redis.Redis, pattern: str, needle: str) -> set[str]:
    return {
        key.decode() for key in client.scan_iter(match=pattern, count=1000)
        if needle.encode() in key or needle.encode() in key_values(client, key)
    }


def define_tools(app: Celery) -> dict[str, Any]:
    @app.task(base=ToolTask, name="privacy.charge", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def charge(card: str, amount_cents: int) -> str:
        if amount_cents < 0:
            raise ValueError(f"card {card} refused a negative amount")
        return f"charged {card}"

    @app.task(base=ToolTask, name="privacy.lookup", shared=False)
    def lookup(card: str) -> str:
        raise ConnectionError(f"lookup of {card} timed out")  # retried, then exhausted

    @app.task(base=ToolTask, name="privacy.update", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def update(card: str) -> dict[str, str]:
        return {"card": card}

    return {"charge": charge, "lookup": lookup, "update": update}


def run_every_ending(app: Celery, main_redis: redis.Redis) -> list[str]:
    """Call the tools so that a secret passes through each way a call ends.

    Returns the task ids that ended as dead letters.
    """
    tools = define_tools(app)
    with running_worker(app):
        assert tools["charge"].delay(SECRET, 100).get(timeout=20) == f"charged {SECRET}"
        assert tools["update"].delay(SECRET).get(timeout=20) == {"card": SECRET}
        refused = tools["charge"].delay(SECRET, -1)
        exhausted = tools["lookup"].delay(SECRET)
        wrong_arguments = app.send_task("privacy.charge", args=[SECRET],
                                        kwargs={"pin": SECRET}, queue="tools")
        unknown = uuid.uuid4().hex
        headers = dict(app.amqp.as_task_v2(unknown, "privacy.gone", args=[SECRET]).headers)
        publish(app, ([SECRET], {"token": SECRET}, EMBED), headers, serializer="json")
        dead = [refused.id, exhausted.id, wrong_arguments.id, unknown]
        letters = DeadLetters(app)
        wait_for(lambda: all(letters.get(task_id) for task_id in dead), timeout=30,
                 what="four dead letters")
        wait_for(lambda: broker_is_empty(app, main_redis), what="the broker to be empty")
    return dead


def test_metadata_keeps_every_secret_out_of_the_audit_log_and_the_listing(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str,
) -> None:
    app = make_app()  # tooleffect_privacy defaults to "metadata"
    dead = run_every_ending(app, main_redis)
    store = f"{prefix}te:"

    # Every key the package wrote (journal, run and global streams, chains,
    # dead-letter indexes): the secret is only in the dead-letter envelopes.
    holding = keys_holding(main_redis, f"{store}*", SECRET)
    assert holding == {f"{store}{{dlq:tools}}:envelopes"}, holding
    events = [event for task_id in dead for event in AuditLog(app).events(task_id)]
    assert {"intent", "outcome", "dead_lettered"} <= {event["phase"] for event in events}
    assert any("args_size" in event for event in events)
    assert any("error_size" in event for event in events)
    assert SECRET not in json.dumps([dict(event) for event in AuditLog(app).tail(1000)])

    # Outside the package's keys, only Celery's own result backend holds it
    # (the results the tools returned): the broker's messages are gone.
    elsewhere = keys_holding(main_redis, f"{prefix}*", SECRET) - holding
    assert all("celery-task-meta-" in key for key in elsewhere), elsewhere

    # The listing (CLI ``dlq list``, Flower's list and JSON API) shows sizes.
    operations = DeadLetterOperations(app)
    page = operations.runtime.dead_letters.page(limit=50)
    assert sorted(letter.task_id for letter in page.letters) == sorted(dead)
    listing = [letter_summary(letter, operations.privacy) for letter in page.letters]
    assert SECRET not in json.dumps(listing)
    for summary in listing:
        assert {"args_size", "kwargs_size", "error_size"} <= set(summary)
        assert not {"args", "kwargs", "error"} & set(summary)

    # Showing one letter gives the envelope a replay needs: the secret is there.
    detail = operations.detail(dead[0])
    assert detail is not None
    assert detail["dead_letter"]["args"] == [SECRET, -1]
    assert SECRET in detail["dead_letter"]["error"]


def test_the_cli_listing_keeps_the_secret_out(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str,
) -> None:
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_tooleffect.admin.cli import tooleffect

    app = make_app()
    run_every_ending(app, main_redis)
    # --wide: at 80 columns the exception column is cut before its note.
    for args in (["dlq", "list", "--json"], ["dlq", "list", "--wide"]):
        result = CliRunner().invoke(tooleffect, args, catch_exceptions=False,
                                    obj=CLIContext(app=app, no_color=True, workdir=None))
        assert result.exit_code == 0, result.output
        assert SECRET not in result.output
        assert "privacy." in result.output


@pytest.mark.parametrize("privacy", ["redacted", "full"])
def test_redacted_and_full_listings(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str, privacy: str,
) -> None:
    app = make_app(tooleffect_privacy=privacy)
    tools = define_tools(app)
    with running_worker(app):
        refused = tools["charge"].delay(SECRET, -1)
        letter = wait_for(lambda: DeadLetters(app).get(refused.id), what="the dead letter")
        tools["charge"].delay(SECRET, 1).get(timeout=20)
    summary = letter_summary(letter, privacy)
    events = AuditLog(app).events(refused.id)
    failed = next(event for event in events if event["phase"] == "outcome")
    holding = keys_holding(main_redis, f"{prefix}te:*", SECRET)
    if privacy == "redacted":
        assert summary["args"] == '["***","***"]' and summary["kwargs"] == "{}"
        assert summary["error"] == "***"
        assert failed["error"] == "***"
        assert next(e for e in events if e["phase"] == "intent")["args"] == '["***","***"]'
        assert holding == {f"{prefix}te:{{dlq:tools}}:envelopes"}, holding
    else:
        assert summary["args"] == json.dumps([SECRET, -1], separators=(",", ":"))
        assert SECRET in summary["error"]
        assert SECRET in failed["error"]
        # The audit log holds it verbatim: the run's events; the global
        # stream's copy keeps only what `audit tail` shows, never a payload.
        assert f"{prefix}te:{{{refused.id}}}:events" in holding
        assert f"{prefix}te:events" not in holding
