"""Messages Celery's consumer refuses before any task code runs end as dead letters.

Each test publishes a real raw message to the app's ``tools`` queue with kombu
and checks that it ends as a dead letter with the right reason, that it left
the broker (queue and unacked hash empty) only after the letter was stored,
and that the worker still runs a normal tool call afterwards.
"""

from __future__ import annotations

import json
import logging
import pickle
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery

from celery_tooleffect import ToolTask
from celery_tooleffect.store.audit import AuditLog
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.dead_letters import DeadLetterReason, DeadLetters
from celery_tooleffect.worker.consumer import DeadLetterStep, install_consumer_step
from tests.conftest import REDIS_URL, RedisServer, running_worker, wait_for

QUEUE = "tools"
TOOL = "tests.bad_messages.echo"


def add_tool(app: Celery) -> Any:
    """A trivial tool: registering it installs the dead-letter consumer step."""

    @app.task(base=ToolTask, name=TOOL, shared=False)
    def echo(value: str) -> str:
        return value

    return echo


def publish(app: Celery, body: Any, headers: dict[str, Any], **options: Any) -> None:
    """Publish one raw message to the ``tools`` queue (the app's key prefix applies)."""
    with app.connection_for_write() as connection:
        connection.Producer().publish(
            body, exchange="", routing_key=QUEUE, headers=headers, retry=False, **options
        )


def task_headers(app: Celery, task_id: str, name: str = TOOL, **changes: Any) -> dict[str, Any]:
    """The protocol 2 headers Celery itself would send for ``name``, with ``changes``."""
    message = app.amqp.as_task_v2(task_id, name, args=["a"], kwargs={})
    headers = dict(message.headers)
    headers.update(changes)
    return headers


def broker_keys(app: Celery) -> tuple[str, str]:
    """The queue list and kombu's unacked hash, under the broker's ``global_keyprefix``."""
    prefix = app.conf.broker_transport_options["global_keyprefix"]
    return f"{prefix}{QUEUE}", f"{prefix}unacked"


def broker_is_empty(app: Celery, client: redis.Redis) -> bool:
    queue, unacked = broker_keys(app)
    return client.llen(queue) == 0 and client.hlen(unacked) == 0


def dead_letter_of(app: Celery, task_id: str) -> DeadLetter:
    letters = DeadLetters(app)
    found: DeadLetter = wait_for(lambda: letters.get(task_id), what=f"dead letter {task_id}")
    return found


def assert_left_broker_and_worker_runs(app: Celery, tool: Any, client: redis.Redis) -> None:
    wait_for(lambda: broker_is_empty(app, client), what="queue and unacked hash to be empty")
    assert tool.delay("still working").get(timeout=20) == "still working"


def dead_lettered_events(app: Celery, run_id: str) -> list[dict[str, str]]:
    return [e for e in AuditLog(app).events(run_id) if e.get("phase") == "dead_lettered"]


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    return make_app()


@pytest.fixture
def tool(app: Celery) -> Any:
    return add_tool(app)


@pytest.fixture
def worker(app: Celery, tool: Any) -> Iterator[Any]:
    with running_worker(app) as started:
        yield started


def test_step_is_installed_once_and_wraps_a_consumer_once(app: Celery) -> None:
    install_consumer_step(app)
    add_tool(app)
    app.finalize()  # binds the tool, which installs the step again
    assert [step for step in app.steps["consumer"] if step is DeadLetterStep] == [DeadLetterStep]

    consumer = SimpleNamespace(
        app=app, on_unknown_message=print, on_unknown_task=print, on_invalid_task=print,
        on_decode_error=print,
    )
    DeadLetterStep(consumer)
    wrapped = consumer.on_unknown_task
    assert wrapped is not print
    DeadLetterStep(consumer)
    assert consumer.on_unknown_task is wrapped


def test_unknown_task_name_is_dead_lettered(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis
) -> None:
    task_id = uuid.uuid4().hex
    name = "tests.bad_messages.no_such_tool"
    body = (["x", 1], {"flag": True}, {"callbacks": None, "errbacks": None, "chain": None,
                                       "chord": None})
    publish(app, body, task_headers(app, task_id, name), serializer="json")

    letter = dead_letter_of(app, task_id)
    assert letter.reason == DeadLetterReason.UNKNOWN_TASK.value
    assert letter.name == name
    assert letter.effect == "non_idempotent_write"  # an unknown name is the worst case
    assert letter.failure_class == "client_error"
    assert letter.exception_type == "NotRegistered"
    assert letter.queue == QUEUE
    assert (letter.args, letter.kwargs) == (["x", 1], {"flag": True})
    assert letter.message is not None
    assert json.loads(letter.message.body)[:2] == [["x", 1], {"flag": True}]
    assert letter.message.content_type == "application/json"
    assert_left_broker_and_worker_runs(app, tool, main_redis)
    assert dead_lettered_events(app, task_id)[0]["status"] == "unknown_task"


def test_message_without_task_name_is_dead_lettered(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis
) -> None:
    """Not a Celery task message at all (protocol 1 body without ``task``)."""
    task_id = uuid.uuid4().hex
    publish(app, {"id": task_id, "args": [], "kwargs": {}}, {}, serializer="json")

    letter = dead_letter_of(app, task_id)
    assert letter.reason == DeadLetterReason.UNKNOWN_TASK.value
    assert letter.name == ""
    assert letter.effect == "non_idempotent_write"
    assert_left_broker_and_worker_runs(app, tool, main_redis)


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        # Claims JSON, is not even UTF-8.
        (b"\xff\xfe{not json", "application/json"),
        # Claims JSON, is text that does not parse.
        (b"{not json", "application/json"),
        # A content type the worker does not accept (pickle): ContentDisallowed.
        (pickle.dumps((["a"], {}, {})), "application/x-python-serialize"),
    ],
    ids=["invalid-bytes", "invalid-json-text", "content-type-not-accepted"],
)
def test_undecodable_body_is_dead_lettered(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis,
    body: bytes, content_type: str,
) -> None:
    task_id = uuid.uuid4().hex
    publish(app, body, task_headers(app, task_id), content_type=content_type,
            content_encoding="binary")

    letter = dead_letter_of(app, task_id)
    assert letter.reason == DeadLetterReason.UNDECODABLE_MESSAGE.value
    assert letter.name == TOOL
    assert letter.effect == "read_only"  # a known tool keeps its declared effect
    assert letter.failure_class == "client_error"
    # The body is kept byte for byte, whatever it is (stored as base64).
    assert letter.message is not None
    assert letter.message.body == body
    assert letter.message.content_type == content_type
    assert letter.message.content_encoding == "binary"
    assert letter.message.headers["id"] == task_id
    assert_left_broker_and_worker_runs(app, tool, main_redis)
    assert dead_lettered_events(app, task_id)[0]["status"] == "undecodable_message"


@pytest.mark.parametrize(
    ("body", "header_changes", "error"),
    [
        # A hybrid protocol 1/2 body whose kwargs are not a mapping.
        ({"args": ["a"], "kwargs": [1, 2]}, {}, "must be a mapping"),
        # A protocol 2 message with an ETA that is not a date.
        ((["a"], {}, {}), {"eta": "not-a-date"}, "invalid ETA value"),
    ],
    ids=["kwargs-not-a-mapping", "bad-eta"],
)
def test_invalid_message_is_dead_lettered(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis,
    body: Any, header_changes: dict[str, Any], error: str,
) -> None:
    task_id = uuid.uuid4().hex
    publish(app, body, task_headers(app, task_id, **header_changes), serializer="json")

    letter = dead_letter_of(app, task_id)
    assert letter.reason == DeadLetterReason.MALFORMED_MESSAGE.value
    assert letter.name == TOOL
    assert letter.failure_class == "client_error"
    assert letter.exception_type == "InvalidTaskError"
    assert error in letter.error
    assert letter.message is not None and letter.message.body
    assert_left_broker_and_worker_runs(app, tool, main_redis)
    assert dead_lettered_events(app, task_id)[0]["status"] == "malformed_message"


def test_refused_message_is_kept_while_the_dead_letter_store_is_down(
    make_app: Callable[..., Celery], prefix: str, second_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the dead-letter store fails; the broker keeps working.

    Dead letters live in the broker's Redis, so the broker runs on a second
    Redis as an ACL user that may read every key but write only the broker's
    keys: storing the dead letter fails with NOPERM (StoreUnavailable) while
    the queue works. The message must stay in the broker (not deleted, not
    marked failed) until the store accepts writes, then end as a dead letter.
    """
    broker_prefix = f"{prefix}broker:"
    admin = second_redis.client()
    admin.execute_command(
        "ACL", "SETUSER", "broker", "on", ">pw", "allchannels", "+@all",
        "%R~*", f"~{broker_prefix}*",
    )
    app = make_app(
        broker_url=f"redis://broker:pw@127.0.0.1:{second_redis.port}/0",
        broker_transport_options={"global_keyprefix": broker_prefix, "visibility_timeout": 60},
        tooleffect_redis_url=REDIS_URL,  # the audit store works; only dead letters fail
    )
    tool = add_tool(app)
    task_id = uuid.uuid4().hex
    caplog.set_level(logging.ERROR, logger="celery_tooleffect.worker.consumer")

    def refusals() -> int:
        return sum("not dead-lettered" in r.getMessage() and task_id in r.getMessage()
                   for r in caplog.records if r.name == "celery_tooleffect.worker.consumer")

    with running_worker(app):
        publish(app, ([], {}, {}), task_headers(app, task_id, "tests.bad_messages.gone"),
                serializer="json")
        # Refused at least twice: the first refusal requeued the message.
        wait_for(lambda: refusals() >= 2, what="two refused attempts to dead-letter")
        assert DeadLetters(app).get(task_id) is None
        assert app.AsyncResult(task_id).state == "PENDING"  # Celery's handler never ran
        wait_for(lambda: admin.llen(f"{broker_prefix}{QUEUE}")
                 + admin.hlen(f"{broker_prefix}unacked") == 1,
                 what="the message in the queue or the unacked hash")

        admin.execute_command("ACL", "SETUSER", "broker", f"~{prefix}te:*")
        letter = dead_letter_of(app, task_id)
        assert letter.reason == DeadLetterReason.UNKNOWN_TASK.value
        wait_for(lambda: broker_is_empty(app, admin), what="queue and unacked hash to be empty")
        assert tool.delay("after").get(timeout=20) == "after"
