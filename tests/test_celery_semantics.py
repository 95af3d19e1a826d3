"""A tool fails as a Celery task fails: what Celery users rely on.

Real ``celery worker`` processes (prefork: every exception crosses the pool's
pipe) of tests/apps/semantics_app.py, whose tasks are tools through the app's
``task_cls`` alone. A body's exception is the result (type, arguments,
traceback), ``AsyncResult.get()`` raises it, errbacks of both styles, chords
and ``task_failure`` receive it; the dead letter still keeps the message and
says why. An exception that cannot be unpickled, that JSON cannot hold, of
4 MiB, or chained a thousand deep, ends the call as Celery ends it and the
worker goes on.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from celery import Celery, chord, group
from celery.exceptions import ChordError

from celery_tooleffect import DeadLetters
from tests.conftest import REDIS_URL, WorkerProcess, app_config, on_broker, wait_for

pytestmark = pytest.mark.timeout(180)

APP = "tests.apps.semantics_app"


@pytest.fixture
def app(make_app: Callable[..., Celery], prefix: str, broker_url: str) -> Celery:
    # The producer's own copy of the app's tools, by name (send_task).
    return make_app(**on_broker(prefix, broker_url))


@pytest.fixture
def worker(app_workers: Callable[..., WorkerProcess]) -> WorkerProcess:
    return app_workers(APP, concurrency=2)


@pytest.fixture
def recorder() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, decode_responses=True)


def test_the_body_exception_is_the_result_and_the_letter_keeps_the_message(
    app: Celery, worker: WorkerProcess, recorder: redis.Redis, prefix: str,
) -> None:
    result = app.send_task("sem.fail", args=["a"])
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    # The worker's module defines the class; here it is rebuilt by name, as
    # Celery's JSON result does for any class it cannot import.
    assert type(raised.value).__name__ == "ExpectedException"
    assert raised.value.args == ("Task expected to fail", "a")
    assert result.state == "FAILURE"
    assert "raise ExpectedException(\"Task expected to fail\", *args)" in result.traceback
    assert "DeadLettered" not in result.traceback
    letter = wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
    assert (letter.reason, letter.exception_type) == ("not_retryable", "ExpectedException")
    assert letter.message is not None and letter.args == ["a"]
    assert wait_for(lambda: recorder.lrange(f"{prefix}failures", 0, -1),
                    what="task_failure") == ["sem.fail ExpectedException"]


def test_a_write_that_fails_shows_its_error_too(
    app: Celery, worker: WorkerProcess,
) -> None:
    result = app.send_task("sem.fail_write")
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    assert type(raised.value).__name__ == "ExpectedException"
    letter = wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
    assert (letter.reason, letter.effect) == ("not_retryable", "non_idempotent_write")


def test_spent_retries_end_with_the_error_retry_raised(
    app: Celery, worker: WorkerProcess,
) -> None:
    result = app.send_task("sem.retry_spent")
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    assert type(raised.value).__name__ == "ExpectedException"
    assert raised.value.args == ("retried",)
    letter = wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
    assert letter.reason == "retries_exhausted"


def test_wrong_arguments_end_with_a_type_error(app: Celery, worker: WorkerProcess) -> None:
    result = app.send_task("sem.add", args=[5], kwargs={"wrong_arg": 5})
    with pytest.raises(TypeError):
        result.get(timeout=30)
    letter = wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
    assert letter.reason == "malformed_message"


def test_errbacks_of_both_styles_receive_the_body_exception(
    app: Celery, worker: WorkerProcess, recorder: redis.Redis, prefix: str,
) -> None:
    signature = app.signature("sem.fail", args=["b"])
    signature.link_error(app.signature("sem.errback"))
    signature.link_error(app.signature("sem.errback_old_style"))
    result = signature.apply_async()
    seen = wait_for(lambda: (lambda got: got if len(got) == 2 else None)(
        recorder.lrange(f"{prefix}errbacks", 0, -1)), what="both errbacks")
    assert sorted(seen) == sorted([f"{result.id} ExpectedException Task expected to fail",
                                   f"{result.id} old-style"])


def test_a_chord_reports_the_member_exception(app: Celery, worker: WorkerProcess) -> None:
    members = [app.signature("sem.add", args=[1, 1]), app.signature("sem.fail", args=["c"])]
    result = chord(members)(app.signature("sem.tsum"))
    # get() raises the member's own error (Celery checks the header first) ...
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    assert type(raised.value).__name__ == "ExpectedException"
    # ... and the body's result is Celery's ChordError naming it.
    body = app.AsyncResult(result.id)
    wait_for(lambda: body.state == "FAILURE", what="the chord body to fail")
    assert isinstance(body.result, ChordError)
    assert "raised ExpectedException('Task expected to fail', 'c')" in str(body.result)
    # A group of tools gives each its own result.
    outcome = group(members).apply_async()
    with pytest.raises(Exception) as failed:
        outcome.get(timeout=30)
    assert type(failed.value).__name__ == "ExpectedException"


def test_an_exception_that_cannot_be_unpickled_leaves_the_worker_running(
    app: Celery, worker: WorkerProcess,
) -> None:
    result = app.send_task("sem.unpickleable")
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    # Celery's own wrapping (get_pickleable_exception): named after the class.
    assert "UnpickleableException" in type(raised.value).__name__ + repr(raised.value)
    letter = wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
    assert letter.exception_type == "UnpickleableException"
    # The worker goes on.
    assert app.send_task("sem.add", args=[2, 3]).get(timeout=30) == 5
    assert worker.process.poll() is None
    assert "Unrecoverable error" not in worker.output()


def test_an_exception_json_cannot_hold_is_stored_as_celery_stores_it(
    app: Celery, worker: WorkerProcess,
) -> None:
    result = app.send_task("sem.unserializable")
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    # Celery's JSON backend keeps the type and the arguments' repr.
    assert type(raised.value).__name__ == "ExpectedException"
    assert "{1, 2, 3}" in str(raised.value.args[0]) and "object at" in str(raised.value)
    letter = wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
    assert letter.exception_type == "ExpectedException" and letter.message is not None
    assert worker.process.poll() is None


def test_a_huge_exception_is_stored_whole(app: Celery, worker: WorkerProcess) -> None:
    size = 4 * 1024 * 1024
    result = app.send_task("sem.huge", args=[size])
    with pytest.raises(ValueError) as raised:
        result.get(timeout=60)
    assert raised.value.args == ("x" * size,)
    assert wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
    assert app.send_task("sem.add", args=[2, 3]).get(timeout=30) == 5


def test_a_deeply_chained_exception_is_stored_and_the_worker_goes_on(
    app: Celery, worker: WorkerProcess,
) -> None:
    result = app.send_task("sem.deep", args=[1000])
    with pytest.raises(ValueError, match="level 999"):
        result.get(timeout=60)
    assert app.send_task("sem.add", args=[2, 3]).get(timeout=30) == 5
    assert worker.process.poll() is None


def test_celerys_own_tasks_are_no_tools_under_task_cls() -> None:
    """``task_cls`` makes Celery's built-in tasks ToolTask subclasses; they
    bind (``chord_unlock`` retries forever) and keep Celery's request."""
    app = Celery("builtins", task_cls="celery_tooleffect:ToolTask", set_as_current=False)
    app.conf.update(app_config("builtins-test:"))

    @app.task(name="b.tool")
    def tool() -> None:
        return None

    app.finalize()
    unlock = app.tasks["celery.chord_unlock"]
    assert unlock.max_retries is None
    assert unlock.Request == "celery.worker.request:Request"
    assert getattr(unlock, "tool_effect", None) is None
    assert app.tasks["b.tool"].tool_effect.value == "read_only"
    assert app.tasks["b.tool"].Request == "celery_tooleffect.worker.request:ToolRequest"
