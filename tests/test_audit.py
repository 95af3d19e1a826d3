"""Audit events: their fields, privacy levels, and record_step's promise."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_tooleffect import AuditEvent, AuditLog, ConfigurationError, ToolEffect, ToolTask
from celery_tooleffect.events import EVENT_FIELDS
from tests.conftest import RedisServer, redis_server, running_worker
from tests.support import join_items, run_fields, run_list

SECRET = "card-4111-1111-1111-1111"


def all_values(client: redis.Redis, prefix: str) -> bytes:
    """Every journal and audit value under ``prefix``, as one blob to grep.

    Dead-letter envelopes are left out: they keep the arguments verbatim
    because a replay needs them (see the README on who can read them).
    """
    blob = b""
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        if b"{dlq:" in key:
            continue
        kind = client.type(key)
        if kind == b"stream":
            for _, fields in client.xrange(key):
                blob += b" ".join(fields.values())
        elif kind == b"list":
            blob += b" ".join(client.lrange(key, 0, -1))
        elif kind == b"hash":
            blob += b" ".join(client.hvals(key))
    return blob


def define_charge(app: Celery) -> ToolTask:
    @app.task(base=ToolTask, name="tools.charge", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def charge(card: str, amount_cents: int) -> str:
        if amount_cents < 0:
            raise ValueError(f"negative amount for {card}")
        return f"charged {card}"

    return charge  # type: ignore[return-value]


def test_events_carry_the_documented_fields(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    charge = define_charge(app)
    with running_worker(app):
        result = charge.delay("c", 100)
        result.get(timeout=20)
    intent, outcome = AuditLog(app).events(result.id)
    required = (set(EVENT_FIELDS) | {"seq"}) - {"duration_ms", "failure_class", "exception_type"}
    assert required <= set(intent) and required <= set(outcome)
    assert outcome["duration_ms"] and float(outcome["duration_ms"]) >= 0
    assert intent["attempt"] == outcome["attempt"] == "1"
    assert (intent["seq"], outcome["seq"]) == ("1", "2")
    assert intent["worker"].count(":") == 1  # hostname:pid
    assert intent["queue"] == "tools" and intent["redelivered"] == "0"


def test_metadata_privacy_keeps_only_sizes(
    make_app: Callable[..., Celery], main_redis: redis.Redis, prefix: str
) -> None:
    app = make_app()
    charge = define_charge(app)
    with running_worker(app):
        ok = charge.delay(SECRET, 100)
        ok.get(timeout=20)
        failed = charge.delay(SECRET, -1)
        failed.get(timeout=20, propagate=False)
    blob = all_values(main_redis, f"{prefix}te:{{")  # journal and audit streams
    assert SECRET.encode() not in blob
    outcome = AuditLog(app).events(ok.id)[1]
    assert int(outcome["args_size"]) == len(f'["{SECRET}",100]')
    assert int(outcome["result_size"]) == len(f'"charged {SECRET}"')
    assert "args" not in outcome and "result" not in outcome
    failure = AuditLog(app).events(failed.id)[1]
    assert failure["exception_type"] == "ValueError" and "error_size" in failure


@pytest.mark.parametrize("privacy", ["redacted", "full"])
def test_redacted_and_full_privacy(make_app: Callable[..., Celery], privacy: str) -> None:
    app = make_app(tooleffect_privacy=privacy)
    charge = define_charge(app)
    result = charge.apply((SECRET,), {"amount_cents": 5})
    outcome = AuditLog(app).events(result.id)[1]
    if privacy == "redacted":
        assert outcome["args"] == '["***"]' and outcome["kwargs"] == '{"amount_cents":"***"}'
        assert outcome["result"] == '"***"'
    else:
        assert SECRET in outcome["args"] and outcome["kwargs"] == '{"amount_cents":5}'
        assert outcome["result"] == f'"charged {SECRET}"'


def test_an_unknown_privacy_level_is_refused(make_app: Callable[..., Celery]) -> None:
    app = make_app(tooleffect_privacy="everything")
    with pytest.raises(ConfigurationError, match="tooleffect_privacy"):
        AuditLog(app)


def test_record_step_never_raises_and_says_whether_it_stored(
    make_app: Callable[..., Celery], second_redis: RedisServer
) -> None:
    app = make_app(tooleffect_redis_url=second_redis.url)
    audit = AuditLog(app)
    event = {"run_id": "r1", "task_id": "t1", "phase": "note", "status": "ok", "text": "é🙂"}
    assert audit.record_step(event) is True
    assert audit.events("r1")[0]["text"] == "é🙂"
    second_redis.refuse_writes()
    assert audit.record_step(event) is False
    second_redis.stop()
    assert audit.record_step(event) is False
    assert audit.record_step({"no_run_id": "x"}) is False


def test_the_task_failed_event_flower_reads_carries_the_failure_class(
    make_app: Callable[..., Celery]
) -> None:
    import threading

    app = make_app(worker_send_task_events=True, task_send_sent_event=False)
    charge = define_charge(app)
    failed_events: list[dict[str, object]] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"task-failed": failed_events.append})
        listener = threading.Thread(
            target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True
        )
        listener.start()
        with running_worker(app):
            result = charge.delay("c", -1)
            result.get(timeout=20, propagate=False)
            from tests.conftest import wait_for

            wait_for(lambda: failed_events, what="the task-failed event")
        receiver.should_stop = True
    event = failed_events[0]
    assert event["uuid"] == result.id
    assert event["failure_class"] == "unknown"
    # The exception is the body's own, as on plain Celery; the event says the
    # call became a dead letter, and why.
    assert event["exception"] == "ValueError('negative amount for c')"
    assert event["dead_letter_reason"] == "not_retryable"


def test_events_are_copied_to_the_global_stream_for_tailing(
    make_app: Callable[..., Celery]
) -> None:
    app = make_app()
    charge = define_charge(app)
    result = charge.apply(("c", 1))
    tail = [e for e in AuditLog(app).tail(50) if e.get("task_id") == result.id]
    assert [e["phase"] for e in tail] == ["intent", "outcome"]


def test_a_store_that_must_load_its_scripts_first_copies_each_event_once(
    make_app: Callable[..., Celery],
) -> None:
    """The global copy rides with the script in one round trip; when the script
    must be loaded first (a new or restarted Redis answers NOSCRIPT), the copy
    already went with the first try and is not sent again with the second."""
    with redis_server() as store:
        app = make_app(broker_url="memory://", result_backend="cache+memory://",
                       tooleffect_redis_url=store.url)
        charge = define_charge(app)
        audit = AuditLog(app)
        assert audit.record_step({"run_id": "r1", "task_id": "t1", "phase": "note",
                                  "status": "ok"})
        result = charge.apply(("c", 1))  # intent (begin_attempt), outcome (transition)
        tail = audit.tail(50)
    assert [e["phase"] for e in tail if e.get("task_id") == "t1"] == ["note"]
    assert [e["phase"] for e in tail if e.get("task_id") == result.id] == ["intent", "outcome"]


# -- read back typed ---------------------------------------------------------------------


def test_events_read_back_are_typed_and_read_as_the_stored_fields(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    app = make_app()
    charge = define_charge(app)
    result = charge.apply(("c", 1))
    audit = AuditLog(app)
    intent, outcome = events = audit.events(result.id)
    stored = run_fields(main_redis, audit.keys.run_events(result.id))
    assert len(stored) == 2
    for seq, (event, fields) in enumerate(zip(events, stored, strict=True), 1):
        assert isinstance(event, AuditEvent)
        # The mapping is the stored text (decoded independently here), with
        # its seq as id, the run id the key names, and the chain's links.
        text = {key.decode(): value.decode() for key, value in fields.items()}
        assert dict(event) == {"id": str(seq), "seq": str(seq), "run_id": result.id, **text,
                               "prev": event.prev, "hash": event.hash}
        assert list(event)[:3] == ["id", "seq", "run_id"]
        assert event.entry_id == str(seq)
        # The attributes are those values parsed.
        assert event.ts == float(text["ts"]) and isinstance(event.ts, float)
        assert event.attempt == int(text["attempt"]) == 1
        assert event.seq == seq
        assert event.redelivered is False
        assert (event.run_id, event.task_id, event.tool, event.effect) == (
            result.id, result.id, "tools.charge", "non_idempotent_write")
    assert (intent.phase, intent.status, outcome.phase, outcome.status) == (
        "intent", "started", "outcome", "succeeded")
    assert (intent.seq, outcome.seq) == (1, 2)
    assert intent.prev == "" and outcome.prev == intent.hash
    assert intent.hash is not None and len(intent.hash) == 40
    assert intent.duration_ms is None
    assert outcome.duration_ms is not None and outcome.duration_ms >= 0
    assert outcome.duration_ms == float(outcome["duration_ms"])
    assert intent.ts <= outcome.ts
    assert outcome.details["args_size"] == str(len('["c",1]'))
    # The outcome stored only what its intent had not said (same task).
    header, elements = run_list(main_redis, audit.keys.run_events(result.id))
    assert header.startswith(b"te1 2 " + outcome.hash.encode())
    assert b"1:t" not in elements[1][16:20] and result.id.encode() not in elements[1]
    # The chain is checked over the raw stored elements, as before.
    assert audit.verify(result.id).intact


def test_tail_reads_back_typed_global_copies(make_app: Callable[..., Celery],
                                            main_redis: redis.Redis) -> None:
    app = make_app()
    charge = define_charge(app)
    result = charge.apply(("c", 1))
    audit = AuditLog(app)
    tail = [event for event in audit.tail(50) if event.task_id == result.id]
    stored = {entry_id.decode(): {k.decode(): v.decode() for k, v in fields.items()}
              for entry_id, fields in main_redis.xrange(audit.keys.global_events)}
    assert [event.phase for event in tail] == ["intent", "outcome"]
    for event in tail:
        assert event.entry_id is not None
        # Lean copies: the run id left out when it is the task id, the
        # time the entry id's; read back whole.
        copy = stored[event.entry_id]
        assert "run_id" not in copy and "ts" not in copy and "queue" not in copy
        assert dict(event) == {"run_id": result.id, **copy,
                               "ts": f"{int(event.entry_id.split('-')[0]) / 1000:.3f}",
                               "id": event.entry_id}
        assert event.ts == float(event["ts"])
        # The copy is the event as the client sent it: what a script adds (the
        # intent's attempt, the chain) is in the run's stream only.
        assert event.attempt == (int(event["attempt"]) if "attempt" in event else None)
        assert (event.seq, event.prev, event.hash) == (None, None, None)


def test_an_event_stored_by_hand_reads_back_with_empty_values(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    app = make_app()
    audit = AuditLog(app)
    fields = {"phase": "note", "ts": "1796345286.29", "attempt": "two", "redelivered": "1",
              "extra": "é"}
    # No header, the common names stored in full: read as they are.
    main_redis.rpush(audit.keys.run_events("run-odd"), join_items(b"0" * 16, [
        (name.encode(), value.encode()) for name, value in fields.items()]))
    [event] = audit.events("run-odd")
    assert dict(event) == {"id": "1", "seq": "1", "run_id": "run-odd", **fields,
                           "prev": "", "hash": event.hash}
    assert (event.ts, event.attempt, event.redelivered, event.seq) == (
        1796345286.29, None, True, 1)
    assert not audit.verify("run-odd").intact
    assert (event.tool, event.status, dict(event.details)) == ("", "", {"extra": "é"})
