"""Bad input, fuzzed with hypothesis and tried by hand.

Pure parts first (key names, the failure classifier, what an audit event says
about a payload), then real messages published to a real in-process worker:
unknown task names, bodies and headers of every shape, forged ``tooleffect_*``
headers, huge arguments and odd unicode. Each message must end as a dead
letter or a clear result (never both, never lost, never a body run for a
message that was refused), and the worker must keep running: a normal tool
call succeeds afterwards.

The hypothesis settings keep the number of examples bounded and the deadline
off, so the whole module runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Reject
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_tooleffect import AuditLog, ToolEffect, ToolTask
from celery_tooleffect.errors import NoSideEffect
from celery_tooleffect.failures import FailureClass, FailureClassifier
from celery_tooleffect.identity import call_digest
from celery_tooleffect.store.audit import describe_payload
from celery_tooleffect.store.dead_letter_record import DeadLetter, conflict_letter_id
from celery_tooleffect.store.dead_letters import DeadLetters
from celery_tooleffect.store.keys import Keys, hash_tag
from tests.conftest import Counter, running_worker, wait_for
from tests.test_bad_messages import broker_is_empty, publish

QUEUE = "tools"
TOOL = "fuzz.record"

PURE = settings(max_examples=300, deadline=None)
#: One worker serves every example of a test; each example waits for its message.
WORKER = settings(
    max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)

# Text with what breaks naive code: lone surrogates, NUL, right-to-left marks,
# emoji, braces and percent signs (the hash-tag escape).
odd_text = st.text(
    alphabet=st.one_of(
        st.characters(codec=None),  # any code point, surrogates included
        st.sampled_from(["\x00", "\u202e", "\u200f", "🙂", "{", "}", "%", "7", "B", "\ud800"]),
    ),
    max_size=40,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | odd_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
    max_leaves=12,
)


# -- pure parts ------------------------------------------------------------------


@PURE
@given(odd_text)
def test_hash_tag_never_lets_a_brace_through_and_is_reversible(value: str) -> None:
    tagged = hash_tag(value)
    assert "{" not in tagged and "}" not in tagged
    unescaped = tagged.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")
    assert unescaped == value


@PURE
@given(odd_text, odd_text)
def test_hash_tag_is_injective(first: str, second: str) -> None:
    if first != second:
        assert hash_tag(first) != hash_tag(second)


@PURE
@given(prefix=odd_text, run_id=odd_text, task_id=odd_text)
def test_all_keys_of_a_run_share_one_hash_slot(prefix: str, run_id: str, task_id: str) -> None:
    """Whatever the run id and task id, a run's keys hash to one slot.

    Also for any prefix, except one whose first ``{`` is followed at once by
    ``}`` (Redis ignores an empty hash tag and hashes the whole key).
    """
    assume("{" not in prefix or not prefix.split("{", 1)[1].startswith("}"))
    keys = Keys(prefix)
    names = [keys.journal(run_id, task_id), keys.run_events(run_id)]
    slots = {key_slot(name.encode("utf-8", "backslashreplace")) for name in names}
    assert len(slots) == 1


class _Raising:
    """An object whose text forms raise, as a tool's result or error might."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __str__ = __repr__


def _exception_type(module: str, name: str, with_property: bool) -> type[Exception]:
    namespace: dict[str, Any] = {"__module__": module}
    if with_property:
        def broken(self: Any) -> Any:
            raise RuntimeError("attribute lookup failed")

        namespace["failure_class"] = property(broken)
        namespace["response"] = property(broken)
    return type(name or "E", (Exception,), namespace)


exception_types = st.builds(
    _exception_type,
    st.sampled_from(["builtins", "requests.exceptions", "httpx", "redis.exceptions",
                     "pybreaker", "celery.exceptions", "kombu.exceptions", "x"]),
    st.sampled_from(["HTTPError", "HTTPStatusError", "ConnectionError", "TimeoutError",
                     "CircuitBreakerError", "ImproperlyConfigured", "OperationalError", "E"]),
    st.booleans(),
)
attribute_values = st.one_of(
    json_values, st.sampled_from(list(FailureClass)), st.builds(_Raising),
    st.builds(lambda status: type("Response", (), {"status_code": status})(),
              st.one_of(st.integers(), st.text(max_size=3), st.none())),
)


@st.composite
def exceptions(draw: st.DrawFn) -> BaseException:
    exc_type = draw(exception_types)
    try:
        exc: BaseException = exc_type(draw(json_values))
    except Exception:  # a type whose constructor refuses: use a plain one
        exc = Exception()
    for name in draw(st.lists(st.sampled_from(["failure_class", "response", "no_side_effect"]),
                              max_size=3)):
        with contextlib.suppress(AttributeError):  # a read-only property
            setattr(exc, name, draw(attribute_values))
    for _ in range(draw(st.integers(0, 3))):
        exc = draw(st.sampled_from([
            lambda inner: Reject(inner, requeue=False),
            lambda inner: NoSideEffect(inner),
            lambda inner: Reject(reason=draw(json_values)),
        ]))(exc)
    return exc


@PURE
@given(exceptions(), st.dictionaries(exception_types, st.sampled_from(list(FailureClass)),
                                     max_size=3))
def test_classify_never_raises(exc: BaseException, registered: dict[Any, FailureClass]) -> None:
    assert isinstance(FailureClassifier(registered).classify(exc), FailureClass)


payload_values = st.one_of(
    json_values,
    st.builds(_Raising),
    st.builds(ValueError, odd_text),
    st.builds(lambda: _self_containing()),
    st.dictionaries(st.tuples(st.integers()), json_values, min_size=1, max_size=2),
    st.binary(max_size=20),
)


def _self_containing() -> list[Any]:
    looped: list[Any] = [1]
    looped.append(looped)
    return looped


@PURE
@given(st.sampled_from(["metadata", "redacted", "full"]),
       st.dictionaries(st.sampled_from(["args", "kwargs", "result", "error"]), payload_values))
def test_describe_payload_never_raises(privacy: str, values: dict[str, Any]) -> None:
    fields = describe_payload(privacy, **values)
    assert all(isinstance(value, str) for value in fields.values())


@PURE
@given(st.dictionaries(st.sampled_from(["args", "kwargs", "result", "error"]), payload_values))
def test_describe_payload_at_metadata_says_only_sizes(values: dict[str, Any]) -> None:
    fields = describe_payload("metadata", **values)
    assert set(fields) == {f"{name}_size" for name, value in values.items() if value is not None}
    assert all(value.isdigit() for value in fields.values())


# -- real messages to a real worker ---------------------------------------------------


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    return make_app()


@pytest.fixture
def tool(app: Celery, counter: Counter) -> Any:
    """A NON_IDEMPOTENT_WRITE that counts its runs by task id."""

    @app.task(base=ToolTask, name=TOOL, shared=False, bind=True,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def record(self: Any, value: Any) -> str:
        counter.hit(str(self.request.id))
        if value == "fail after the write":
            raise ValueError("failed after the write")  # not retryable: a dead letter
        return "ok"

    return record


@pytest.fixture
def worker(app: Celery, tool: Any) -> Iterator[Any]:
    with running_worker(app) as started:
        yield started


def headers_for(app: Celery, task_id: str, name: str = TOOL, **changes: Any) -> dict[str, Any]:
    headers = dict(app.amqp.as_task_v2(task_id, name, args=["a"], kwargs={}).headers)
    headers.update(changes)
    return headers


EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def ending(app: Celery, task_id: str) -> tuple[str, Any]:
    """How ``task_id`` ended: ``("dead_letter", letter)`` or ``(state, result)``.

    Waits (bounded) until it has ended; a dead letter wins over a backend
    state, since a dead-lettered task is also marked failed. Its FAILURE may
    be stored before its letter: :func:`assert_ended_cleanly` looks again
    once the message has left the broker.
    """
    letters = DeadLetters(app)

    def ended() -> tuple[str, Any] | None:
        result = app.AsyncResult(task_id)
        state = result.state
        letter = letters.get(task_id)
        if letter is not None:
            return "dead_letter", letter
        if state in ("SUCCESS", "FAILURE", "REVOKED"):
            return state, result.result
        return None

    found: tuple[str, Any] = wait_for(ended, timeout=20, what=f"{task_id} to end")
    return found


def assert_ended_cleanly(app: Celery, main_redis: redis.Redis, counter: Counter,
                         task_id: str) -> tuple[str, Any]:
    """The message ended, left the broker, and the body ran only if it succeeded."""
    how, detail = ending(app, task_id)
    wait_for(lambda: broker_is_empty(app, main_redis), timeout=20,
             what="queue and unacked hash to be empty")
    if how == "FAILURE":
        # The pool stores FAILURE before the main process stores the letter
        # and then rejects the message (docs/guide.md, "What a failed call's
        # result holds"): with the message gone, a letter is there if any.
        letter = DeadLetters(app).get(task_id)
        if letter is not None:
            how, detail = "dead_letter", letter
    runs = counter.value(task_id)
    if how == "SUCCESS":
        assert runs == 1, f"{task_id} succeeded with {runs} runs"
        assert DeadLetters(app).get(task_id) is None
    else:
        assert runs == 0, f"{task_id} ended {how} ({detail!r:.200}) after {runs} runs"
    if how == "dead_letter":
        assert detail.failure_class == "client_error"
        assert detail.reason in ("unknown_task", "undecodable_message", "malformed_message")
    return how, detail


def assert_still_working(tool: Any) -> None:
    assert tool.delay("still working").get(timeout=20) == "ok"


header_names = st.one_of(
    st.sampled_from(["lang", "root_id", "parent_id", "group", "group_index", "retries",
                     "timelimit", "shadow", "argsrepr", "kwargsrepr", "origin",
                     "ignore_result", "stamped_headers", "stamps", "replaced_task_nesting",
                     "tooleffect_run_id", "tooleffect_effect", "tooleffect_token",
                     "tooleffect_replay", "TOOLEFFECT_RUN_ID", "is_eager", "called_directly",
                     "delivery_info", "hostname"]),
    odd_text,
)


@WORKER
@given(changes=st.dictionaries(header_names, json_values, max_size=4))
def test_fuzzed_headers_end_as_a_dead_letter_or_a_clean_run(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter,
    changes: dict[str, Any],
) -> None:
    task_id = uuid.uuid4().hex
    changes.pop("id", None)
    changes.pop("task", None)
    publish(app, (["v"], {}, EMBED), headers_for(app, task_id, **changes), serializer="json")
    how, detail = assert_ended_cleanly(app, main_redis, counter, task_id)
    forged = [name for name in changes
              if name.lower().startswith("tooleffect_") and name != "tooleffect_run_id"]
    if forged:  # a producer cannot relabel, skip the journal or forge a replay
        assert how == "dead_letter" and detail.reason == "malformed_message", (how, detail)
    if how == "SUCCESS":
        run_id = changes.get("tooleffect_run_id") or task_id
        phases = [event["phase"] for event in AuditLog(app).events(str(run_id))
                  if event["task_id"] == task_id]
        assert phases == ["intent", "outcome"]


bodies = st.one_of(
    json_values.map(lambda value: (json.dumps(value).encode(), "application/json")),
    st.tuples(json_values, json_values, json_values).map(
        lambda body: (json.dumps(list(body)).encode(), "application/json")),
    st.binary(max_size=64).map(lambda data: (data, "application/json")),
    st.binary(max_size=64).map(lambda data: (data, "application/x-python-serialize")),
    st.binary(max_size=64).map(lambda data: (data, "application/octet-stream")),
)


@WORKER
@given(body=bodies)
def test_fuzzed_bodies_end_as_a_dead_letter_or_a_clean_run(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter,
    body: tuple[bytes, str],
) -> None:
    task_id = uuid.uuid4().hex
    data, content_type = body
    publish(app, data, headers_for(app, task_id), content_type=content_type,
            content_encoding="utf-8" if content_type == "application/json" else "binary")
    how, detail = assert_ended_cleanly(app, main_redis, counter, task_id)
    assert how in ("dead_letter", "SUCCESS"), (how, detail)


@WORKER
@given(name=odd_text, args=st.lists(json_values, max_size=3),
       kwargs=st.dictionaries(odd_text, json_values, max_size=3))
def test_fuzzed_unknown_task_names_and_arguments_are_dead_lettered(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter,
    name: str, args: list[Any], kwargs: dict[str, Any],
) -> None:
    task_id = uuid.uuid4().hex
    if name == TOOL:
        name += "?"
    publish(app, (args, kwargs, EMBED), headers_for(app, task_id, name=name),
            serializer="json")
    how, detail = assert_ended_cleanly(app, main_redis, counter, task_id)
    assert how == "dead_letter" and detail.reason == "unknown_task", (how, detail)
    assert detail.effect == "non_idempotent_write"


@WORKER
@given(args=st.lists(json_values, max_size=3),
       kwargs=st.dictionaries(odd_text, json_values, max_size=3))
def test_fuzzed_arguments_to_a_known_tool(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter,
    args: list[Any], kwargs: dict[str, Any],
) -> None:
    """``record(value)`` takes exactly one argument: anything else is refused unrun."""
    task_id = uuid.uuid4().hex
    publish(app, (args, kwargs, EMBED), headers_for(app, task_id), serializer="json")
    how, detail = assert_ended_cleanly(app, main_redis, counter, task_id)
    fits = (len(args) == 1 and not kwargs) or (not args and set(kwargs) == {"value"})
    if fits:
        assert how == "SUCCESS", (how, detail)
    else:
        assert how == "dead_letter" and detail.reason == "malformed_message", (how, detail)


def test_the_worker_keeps_running_after_fuzzing(tool: Any, worker: Any) -> None:
    assert_still_working(tool)


# -- by hand ----------------------------------------------------------------------------

#: (label, body, header changes, what the dead letter's error says)
MALFORMED = [
    ("body is a number", 1, {}, "unreadable task message"),
    ("body is text", "x", {}, "unreadable task message"),
    ("body is a short list", [1], {}, "unreadable task message"),
    ("embed is null", [["a"], {}, None], {}, "embed must be a mapping"),
    ("callbacks is a number", [["a"], {}, dict(EMBED, callbacks=5)], {},
     "'callbacks' must be a list of signatures"),
    ("chain is text", [["a"], {}, dict(EMBED, chain="x")], {},
     "'chain' must be a list of signatures"),
    ("args is text", ["a", {}, EMBED], {}, "args must be a list"),
    ("kwargs is a list", [["a"], [1], EMBED], {}, "kwargs must be a mapping"),
    ("retries is text", [["a"], {}, EMBED], {"retries": "abc"}, "'retries' must be a count"),
    ("retries is negative", [["a"], {}, EMBED], {"retries": -5}, "'retries' must be a count"),
    ("timelimit is text", [["a"], {}, EMBED], {"timelimit": "x"}, "'timelimit' must be"),
    ("id is a number", [["a"], {}, EMBED], {"id": 12345}, "'id' must be text"),
    ("id is a mapping", [["a"], {}, EMBED], {"id": {"x": 1}}, "'id' must be text"),
    ("root id is a number", [["a"], {}, EMBED], {"root_id": 5}, "'root_id' must be text"),
    ("run id is a mapping", [["a"], {}, EMBED], {"tooleffect_run_id": {"a": 1}},
     "'tooleffect_run_id' must be text"),
    ("run id is empty", [["a"], {}, EMBED], {"tooleffect_run_id": ""},
     "'tooleffect_run_id' is empty"),
    ("group is a number", [["a"], {}, EMBED], {"group": 5}, "'group' must be text"),
    ("shadow is a number", [["a"], {}, EMBED], {"shadow": 5}, "'shadow' must be text"),
    ("stamps are a number", [["a"], {}, EMBED], {"stamped_headers": 5, "stamps": "x"},
     "'stamped_headers' must be a list"),
    ("ignore_result is text", [["a"], {}, EMBED], {"ignore_result": "x"},
     "'ignore_result' must be true or false"),
]


def test_malformed_messages_are_dead_lettered_and_the_worker_keeps_running(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter,
) -> None:
    """Each of these stopped the worker, ran a refused body, or vanished without a
    dead letter before ``celery_tooleffect.worker.strategy`` checked the message."""
    problems = []
    for label, body, changes, error in MALFORMED:
        task_id = uuid.uuid4().hex
        headers = headers_for(app, task_id, **changes)
        letter_id = task_id if "id" not in changes else str(changes["id"])
        publish(app, body, headers, serializer="json")
        how, letter = ending(app, letter_id)
        if how != "dead_letter":
            problems.append(f"{label}: ended {how} ({letter!r:.100})")
            continue
        if letter.reason != "malformed_message" or error not in letter.error:
            problems.append(f"{label}: {letter.reason}: {letter.error}")
        if counter.value(task_id) or counter.value(letter_id):
            problems.append(f"{label}: the body ran")
    assert not problems, "\n".join(problems)
    wait_for(lambda: broker_is_empty(app, main_redis), what="queue and unacked hash to be empty")
    assert_still_working(tool)


def test_wrong_argument_types_end_as_a_clear_failure(
    app: Celery, tool: Any, counter: Counter,
) -> None:
    """The signature fits, the types do not: the body raises TypeError, a class
    nothing retries (``unknown``), so the write is dead-lettered ``not_retryable``."""

    @app.task(base=ToolTask, name="fuzz.add", shared=False, bind=True,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def add(self: Any, a: int, b: int) -> int:
        counter.hit(str(self.request.id))
        return a + b

    with running_worker(app):
        task_id = uuid.uuid4().hex
        publish(app, (["1", None], {}, EMBED), headers_for(app, task_id, name="fuzz.add"),
                serializer="json")
        how, letter = ending(app, task_id)
        assert how == "dead_letter", (how, letter)
        assert (letter.reason, letter.failure_class, letter.exception_type) == (
            "not_retryable", "unknown", "TypeError")
        assert counter.value(task_id) == 1
        assert add.delay(1, 2).get(timeout=20) == 3
        assert_still_working(tool)


@pytest.mark.parametrize("task_id", [None, 12345, ""], ids=["none", "number", "empty"])
def test_an_unknown_task_without_a_usable_id_does_not_stop_the_worker(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, task_id: Any,
) -> None:
    """Celery's own handler marks an unknown task failed by its id, and raised for
    an id that is not text: after the message was rejected, out of the event loop."""
    run_id = uuid.uuid4().hex
    headers = headers_for(app, "placeholder", name="fuzz.no_such_tool", id=task_id,
                          tooleffect_run_id=run_id)
    publish(app, (["a"], {}, EMBED), headers, serializer="json")
    events = wait_for(lambda: [e for e in AuditLog(app).events(run_id)
                               if e["phase"] == "dead_lettered"], what="the dead letter event")
    letter = DeadLetters(app).get(events[0]["task_id"])
    assert letter is not None and letter.reason == "unknown_task"
    wait_for(lambda: broker_is_empty(app, main_redis), what="queue and unacked hash to be empty")
    assert_still_working(tool)


def test_reserved_fields_in_a_protocol_1_body_have_no_effect(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter,
) -> None:
    """A protocol 1 (hybrid) body is turned into headers by Celery field by field:
    ``tooleffect_*`` keys in it never reach the request, so the tool runs as declared,
    journalled, once."""
    task_id = uuid.uuid4().hex
    body = {"task": TOOL, "id": task_id, "args": ["a"], "kwargs": {},
            "tooleffect_effect": "read_only", "tooleffect_token": "forged"}
    publish(app, body, {}, serializer="json")
    how, _ = assert_ended_cleanly(app, main_redis, counter, task_id)
    assert how == "SUCCESS"
    intent, outcome = AuditLog(app).events(task_id)
    assert (intent["phase"], outcome["phase"]) == ("intent", "outcome")
    assert intent["effect"] == outcome["effect"] == "non_idempotent_write"
    assert_still_working(tool)


def test_a_producer_cannot_replay_an_ended_write_by_publishing_it_again(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter,
) -> None:
    """Publishing a succeeded or dead-lettered write's message again (same task id
    and run, ``retries`` 0, or with any header a replay might be thought to need)
    does not run it: only an operator's replay resets the journal."""
    done = tool.delay("once")
    assert done.get(timeout=20) == "ok"
    failed = tool.delay("fail after the write")
    wait_for(lambda: DeadLetters(app).get(failed.id), what="the dead letter")
    for task_id, arg in ((done.id, "once"), (failed.id, "fail after the write")):
        assert counter.value(task_id) == 1
        publish(app, ([arg], {}, EMBED), headers_for(app, task_id, retries=0),
                serializer="json")
        wait_for(lambda task_id=task_id: any(
            e["phase"] == "duplicate_ignored" for e in AuditLog(app).events(task_id)),
            what="the duplicate to be ignored")
        for forged in ("tooleffect_replay", "tooleffect_token", "tooleffect_state"):
            again = headers_for(app, task_id, **{forged: "1"})
            publish(app, ([arg], {}, EMBED), again, serializer="json")
        # With other arguments it is another call under a borrowed id: a
        # conflict (docs/identity.md), not a run.
        publish(app, (["again"], {}, EMBED), headers_for(app, task_id, retries=0),
                serializer="json")
        wait_for(lambda task_id=task_id: DeadLetters(app).get(
            conflict_letter_id(task_id, call_digest(["again"], {}))),
            what="the conflict's dead letter")
        wait_for(lambda: broker_is_empty(app, main_redis), what="the copies to be dropped")
        assert counter.value(task_id) == 1
    assert_still_working(tool)


@pytest.mark.parametrize("privacy", ["metadata", "full"])
def test_odd_unicode_in_run_ids_and_arguments_is_stored_and_read_back(
    make_app: Callable[..., Celery], main_redis: redis.Redis, counter: Counter, privacy: str,
) -> None:
    """Lone surrogates (valid in a JSON message), NUL, RTL marks and emoji."""
    app = make_app(tooleffect_privacy=privacy)

    @app.task(base=ToolTask, name=TOOL, shared=False, bind=True,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def record(self: Any, value: Any) -> Any:
        counter.hit(str(self.request.id))
        return value

    odd = "a\ud800b\x00c\u202ed🙂{}%"
    with running_worker(app):
        task_id = uuid.uuid4().hex
        publish(app, ([odd], {}, EMBED), headers_for(app, task_id, tooleffect_run_id=odd),
                serializer="json")
        how, _ = assert_ended_cleanly(app, main_redis, counter, task_id)
        assert how == "SUCCESS"
        events = AuditLog(app).events(odd)
        assert [e["phase"] for e in events] == ["intent", "outcome"]
        assert events[0]["run_id"].startswith("a\\ud800b\x00c\u202ed🙂")
        if privacy == "full":
            assert "\\\\ud800" in events[1]["args"] or "\\ud800" in events[1]["args"]
        assert record.delay("fine").get(timeout=20) == "fine"


def test_odd_unicode_and_huge_values_in_audit_events(
    make_app: Callable[..., Celery],
) -> None:
    audit = AuditLog(make_app())
    run_id = f"run-\ud800-{uuid.uuid4().hex}"
    huge = "x" * (8 * 1024 * 1024)
    odd = {"run_id": run_id, "task_id": "t", "phase": "note", "status": "ok",
           "nul": "a\x00b", "rtl": "\u202eabc", "emoji": "🙂" * 1000, "surrogate": "\udcff",
           "huge": huge, "": "empty name", "\ud800": "surrogate name"}
    assert audit.record_step(odd) is True
    (stored,) = audit.events(run_id)
    assert stored["nul"] == "a\x00b" and stored["rtl"] == "\u202eabc"
    assert stored["emoji"] == "🙂" * 1000 and stored["huge"] == huge
    assert stored["surrogate"] == "\\udcff"  # escaped: Redis holds UTF-8
    assert stored[""] == "empty name"


@pytest.mark.parametrize("fits", [True, False], ids=["valid-call", "unknown-tool"])
def test_huge_arguments(
    app: Celery, tool: Any, worker: Any, main_redis: redis.Redis, counter: Counter, fits: bool,
) -> None:
    """A 5 MB argument: a valid call runs once and its audit says only the size; a
    refused one is dead-lettered with its whole body, and the listing stays small."""
    from celery_tooleffect.admin.operations import letter_summary

    big = "x" * (5 * 1024 * 1024)
    task_id = uuid.uuid4().hex
    name = TOOL if fits else "fuzz.no_such_tool"
    publish(app, ([big], {}, EMBED), headers_for(app, task_id, name=name), serializer="json")
    how, detail = assert_ended_cleanly(app, main_redis, counter, task_id)
    if fits:
        assert how == "SUCCESS"
        _, outcome = AuditLog(app).events(task_id)
        assert int(outcome["args_size"]) == len(big) + 4
        assert len(json.dumps(dict(outcome))) < 2000
    else:
        letter: DeadLetter = detail
        assert how == "dead_letter" and letter.args == [big]
        assert len(json.dumps(letter_summary(letter, "metadata"), default=str)) < 2000
    assert_still_working(tool)
