"""A dead letter's lifecycle on a real Redis (docs/operations.md, "A dead letter's
lifecycle"): once replayed or purged, a letter leaves nothing that lives longer
than ``tooleffect_retention``; an unresolved letter keeps every key, without a
TTL; a worker at start, and Flower's Dead letters page (``celery -A
tests.apps.tool_app tooleffect flower``, tests/test_flower.py's fixture), warn
about unresolved letters past a threshold."""

from __future__ import annotations

import html
import json
import re
import time
import uuid
from collections.abc import Callable

import redis
from celery import Celery

from celery_tooleffect import DeadLetter, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.admin.operations import DeadLetterOperations, Outcome
from celery_tooleffect.admin.operations.rules import letter_run_id
from celery_tooleffect.settings import settings_for
from celery_tooleffect.store.dead_letter_queries import DeadLetterQuery
from celery_tooleffect.store.keys import Keys
from tests import test_flower as base
from tests.conftest import Counter, WorkerProcess, running_worker, wait_for
from tests.letters import letter_of_call
from tests.test_cli import invoke
from tests.test_flower import FlowerProcess, _request

# tests/test_flower.py's fixture, under its own name.
start_flower = base.start_flower

NAMES = {
    ToolEffect.READ_ONLY: "tools.read",
    ToolEffect.IDEMPOTENT_WRITE: "tools.idempotent",
    ToolEffect.NON_IDEMPOTENT_WRITE: "tools.write",
}
#: Seconds every key of a resolved letter may live at most: the smallest
#: retention the suite's settings allow is 60 x (2 + 2) + 0.2 x 2 = 240.4 s.
RETENTION = 3600


def _tool_app(make_app: Callable[..., Celery], counter: Counter, client: redis.Redis,
              prefix: str) -> Celery:
    """Tools that fail (not retryable) until ``fixed:<key>`` is set."""
    app = make_app(tooleffect_retention=RETENTION, result_expires=RETENTION)

    def body(key: str) -> str:
        counter.hit(key)
        if not client.exists(f"{prefix}fixed:{key}"):
            raise ValueError(f"provider rejected {key}")
        return f"done:{key}"

    for effect, name in NAMES.items():
        app.task(base=ToolTask, effect=effect, name=name, shared=False)(body)
    return app


def _dead_letter(app: Celery, effect: ToolEffect, key: str) -> DeadLetter:
    result = app.send_task(NAMES[effect], args=[key],
                           headers={"tooleffect_run_id": f"run-{key}-{uuid.uuid4().hex[:6]}"})
    return wait_for(lambda: DeadLetters(app).get(result.id), what=f"dead letter {key}")


def _succeeded(app: Celery, task_id: str) -> None:
    wait_for(lambda: app.AsyncResult(task_id).state == "SUCCESS", what=f"{task_id} to succeed")


def _ttls(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Every key under ``prefix`` and its TTL in seconds (-1: none)."""
    keys = [key.decode() for key in client.scan_iter(match=f"{prefix}*", count=1000)]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.ttl(key)
    return dict(zip(keys, (int(ttl) for ttl in pipe.execute()), strict=True))


def test_a_resolved_letter_leaves_nothing_longer_than_the_retention(
        make_app: Callable[..., Celery], counter: Counter, main_redis: redis.Redis,
        prefix: str) -> None:
    app = _tool_app(make_app, counter, main_redis, prefix)
    settings = settings_for(app)
    assert settings.journal_ttl == RETENTION
    keys = Keys(settings.key_prefix)
    operations = DeadLetterOperations(app)
    with running_worker(app):
        read = _dead_letter(app, ToolEffect.READ_ONLY, "lc-read")
        idem = _dead_letter(app, ToolEffect.IDEMPOTENT_WRITE, "lc-idem")
        purged = _dead_letter(app, ToolEffect.NON_IDEMPOTENT_WRITE, "lc-purged")
        kept = _dead_letter(app, ToolEffect.NON_IDEMPOTENT_WRITE, "lc-kept")
        # A letter of a queue, a reason and a failure class of its own: when it
        # goes, they leave the sets of queues and facets.
        other = letter_of_call(app, task_id=f"lc-other-{uuid.uuid4().hex[:6]}",
                               name="tools.gone", run_id="run-lc-other", queue="reports",
                               reason="unknown_task", failure_class="client_error",
                               effect="read_only")
        assert DeadLetters(app).store(other)
        assert main_redis.ttl(keys.dead_letters("reports")) == -1  # unresolved: no TTL

        main_redis.set(f"{prefix}fixed:lc-read", "1")
        main_redis.set(f"{prefix}fixed:lc-idem", "1")
        for letter in (read, idem):
            answer = operations.replay(letter.task_id, actor="ops", bulk=True)
            assert answer.outcome is Outcome.DONE, answer.message
        for letter in (purged, other):
            answer = operations.purge(letter.task_id, actor="ops", reason="lifecycle test")
            assert answer.outcome is Outcome.DONE, answer.message
        _succeeded(app, read.task_id)
        _succeeded(app, idem.task_id)
    # Each replayed body ran once more, the purged and the kept ones never again.
    assert [counter.value(key) for key in ("lc-read", "lc-idem", "lc-purged", "lc-kept")] == [
        2, 2, 1, 1]

    ttls = _ttls(main_redis, prefix)
    # The unresolved letter's keys: no TTL, and they hold that letter only.
    dead_letter_keys = {
        keys.dead_letters("tools"), keys.dead_letter_index("tools"), keys.dead_letter_all,
        keys.dead_letter_locations, keys.dead_letter_counts, keys.dead_letter_queues,
        keys.dead_letter_facets,
        *(keys.dead_letter_facet(facet, value) for facet, value in (
            ("reason", kept.reason), ("failure_class", kept.failure_class),
            ("effect", kept.effect))),
    }
    assert {key for key in ttls if key.startswith(f"{settings.key_prefix}dlq:")
            or key.startswith(f"{settings.key_prefix}{{dlq:")} == dead_letter_keys
    assert {key: ttls[key] for key in dead_letter_keys} == dict.fromkeys(dead_letter_keys, -1)
    assert main_redis.hkeys(keys.dead_letters("tools")) == [kept.task_id.encode()]
    assert main_redis.hgetall(keys.dead_letter_locations) == {
        kept.task_id.encode(): b"tools"}
    assert main_redis.smembers(keys.dead_letter_queues) == {b"tools"}
    assert main_redis.smembers(keys.dead_letter_facets) == {
        f"reason:{kept.reason}".encode(), f"failure_class:{kept.failure_class}".encode(),
        b"effect:non_idempotent_write"}
    for index in dead_letter_keys - {keys.dead_letters("tools"), keys.dead_letter_locations,
                                     keys.dead_letter_counts, keys.dead_letter_queues,
                                     keys.dead_letter_facets}:
        assert main_redis.zrange(index, 0, -1) == [kept.task_id.encode()], index
    assert DeadLetters(app).stats().total == 1

    # Everything else lives at most the retention. Not the letters' own: the
    # test's counters, kombu's bindings of the queue, the global stream
    # (capped by length, tooleffect_global_stream_maxlen, not by time) and the
    # rollback watch's mark of each worker process (docs/redis.md#rollbacks).
    not_the_letters = (f"{prefix}count:", f"{prefix}fixed:", f"{prefix}_kombu.binding",
                       f"{settings.key_prefix}events", f"{settings.key_prefix}store:")
    # The unresolved write's journal entry lives as long as its letter (DESIGN
    # §7): a copy of its message that comes back after the retention still
    # finds it dead-lettered, and its replay still sees how it ended.
    kept_journal = keys.journal(letter_run_id(kept), kept.task_id)
    assert ttls[kept_journal] == -1
    assert main_redis.hget(kept_journal, "state") == b"dead_lettered"
    left = {key: ttl for key, ttl in ttls.items()
            if key not in dead_letter_keys | {kept_journal}
            and not key.startswith(not_the_letters)}
    assert left, "the runs' journal and streams are there"
    assert {key: ttl for key, ttl in left.items() if not 0 < ttl <= RETENTION} == {}
    # The replayed and the purged letters' journal entries are among them: the
    # purge gave the purged write's entry its TTL back.
    journal_keys = [key for key in left if any(
        letter.task_id in key for letter in (read, idem, purged))]
    assert journal_keys, sorted(left)
    assert keys.journal(letter_run_id(purged), purged.task_id) in left


def test_a_worker_warns_at_start_about_unresolved_letters_past_a_threshold(
        make_app: Callable[..., Celery], prefix: str,
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    app = make_app()
    for i, queue in enumerate(["tools", "tools", "tools", "reports"]):
        letter = letter_of_call(app, task_id=f"warn-{i}-{uuid.uuid4().hex[:6]}",
                                name="tools.write", run_id=f"run-warn-{i}", queue=queue,
                                reason="not_retryable", failure_class="auth",
                                effect="non_idempotent_write")
        if queue == "reports":
            letter.dead_lettered_at = time.time() - 7200  # waited two hours
        assert DeadLetters(app).store(letter)

    # spawn_worker returns once the worker is ready: its start-up checks ran.
    worker = spawn_worker(TE_DLQ_WARN_COUNT="2", TE_DLQ_WARN_AGE="3600")
    lines = [line for line in worker.output().splitlines() if "dead-letters-waiting" in line]
    assert len(lines) == 2, lines
    assert ("queue 'reports' holds 1 unresolved dead letter(s), the oldest stored 2h ago: "
            "older than tooleffect_dead_letter_warn_age (3600s)") in lines[0]
    assert "queue 'tools' holds 3 unresolved dead letter(s), the oldest stored " in lines[1]
    assert ("more than tooleffect_dead_letter_warn_count (2); replay or purge them "
            "(celery tooleffect dlq list -Q tools); see "
            "docs/operations.md#dead-letters-waiting") in lines[1]
    assert "warn_age" not in lines[1]
    # Below both thresholds (the defaults): no warning.
    quiet = spawn_worker()
    assert "ready" in quiet.output() and "dead-letters-waiting" not in quiet.output()


def test_flowers_dead_letters_page_shows_a_banner_past_a_threshold(
        make_app: Callable[..., Celery], start_flower: Callable[..., FlowerProcess]) -> None:
    app = make_app()
    letters = DeadLetters(app)
    old = letter_of_call(app, task_id=f"banner-{uuid.uuid4().hex[:6]}", name="tools.write",
                         run_id="run-banner", queue="tools", reason="not_retryable",
                         failure_class="auth", effect="non_idempotent_write")
    old.dead_lettered_at = time.time() - 3 * 86400
    assert letters.store(old)
    flower = start_flower(TE_DLQ_WARN_COUNT="5", TE_DLQ_WARN_AGE="86400")
    status, page = _request(f"{flower.url}/dead-letters")
    assert status == 200, page
    banner = page.split('id="dlq-waiting"', 1)[1].split("</div>", 1)[0]
    assert re.findall(r"<li>(.*?)</li>", banner) == [html.escape(
        "queue 'tools' holds 1 unresolved dead letter(s), the oldest stored 3d ago: older "
        "than tooleffect_dead_letter_warn_age (86400s); replay or purge them (celery "
        "tooleffect dlq list -Q tools)")]

    # Purged by age from the CLI's operations: the banner goes with it.
    purged = list(DeadLetterOperations(app).purge_matching(
        DeadLetterQuery(), older_than=86400, actor="ops", reason="too old"))
    assert [(result.task_id, result.outcome) for result in purged] == [
        (old.task_id, Outcome.DONE)]
    status, page = _request(f"{flower.url}/dead-letters")
    assert status == 200 and 'id="dlq-waiting"' not in page


def test_dlq_purge_older_than_purges_by_age_without_all(
        make_app: Callable[..., Celery]) -> None:
    app = make_app()
    letters = DeadLetters(app)
    stored = {}
    for key, queue, age in [("old", "tools", 2 * 86400), ("old-reports", "reports", 2 * 86400),
                            ("young", "tools", 60)]:
        letter = letter_of_call(app, task_id=f"{key}-{uuid.uuid4().hex[:6]}",
                                name="tools.read", run_id=f"run-{key}", queue=queue,
                                reason="not_retryable", failure_class="auth",
                                effect="read_only")
        letter.dead_lettered_at = time.time() - age
        assert letters.store(letter)
        stored[key] = letter.task_id

    assert invoke(app, "dlq", "purge", stored["old"], "--older-than", "1d").exit_code == 2
    purged = invoke(app, "dlq", "purge", "--older-than", "1d", "-Q", "tools", "--yes", "--json")
    assert purged.exit_code == 0, purged.output
    assert [(row["task_id"], row["outcome"]) for row in json.loads(purged.stdout)["results"]] == [
        (stored["old"], "done")]
    assert letters.get(stored["old"]) is None
    assert letters.get(stored["old-reports"]) is not None  # another queue
    assert letters.get(stored["young"]) is not None  # younger than a day
    assert invoke(app, "dlq", "purge", "--older-than", "1d", "--yes").exit_code == 0
    assert letters.get(stored["old-reports"]) is None
    assert letters.get(stored["young"]) is not None
