"""The dead-letter gauges on Flower's ``/metrics``, their joint counts, and the Grafana
dashboard.

An in-process worker (threads pool) consuming the queues ``tools`` and ``reports``
makes real dead letters of different reasons, failure classes and effects: tools
that fail non-retryably (ValueError, an ``auth`` error), one whose connection
errors exhaust its retries, and a task name no worker knows.
``celery -A tests.apps.tool_app tooleffect flower`` (tests/test_flower.py's
fixture) runs as a subprocess on the same key prefix; ``/metrics`` is scraped
over HTTP and parsed with prometheus_client's parser, and compared with ``dlq
stats --json``. The store-level tests need no worker: the joint counts never go
below zero, and a store that does not answer leaves its gauges out (with a
warning) while the rest of the registry is served.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from celery.contrib.testing.worker import start_worker
from click.testing import CliRunner
from prometheus_client import Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from celery_tooleffect import DeadLetter, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.admin.approvals import Approvals
from celery_tooleffect.admin.cli import tooleffect
from celery_tooleffect.admin.flower.metrics import (
    APPROVALS_GAUGE,
    DEAD_LETTERS_GAUGE,
    OLDEST_DEAD_LETTER_GAUGE,
    export_store_gauges,
)
from celery_tooleffect.admin.operations import DeadLetterOperations, Outcome
from celery_tooleffect.store.dead_letter_queries import DeadLetterCount
from celery_tooleffect.testing import free_port
from tests import test_flower as base
from tests.conftest import REDIS_URL, TESTS, wait_for
from tests.test_flower import FlowerProcess, _request

pytestmark = pytest.mark.timeout(180)

# tests/test_flower.py's fixture, under its own name.
start_flower = base.start_flower

DASHBOARD = TESTS.parent / "docs" / "grafana" / "tooleffect.json"
LABELS = {
    DEAD_LETTERS_GAUGE: ("queue", "reason", "failure_class", "effect"),
    OLDEST_DEAD_LETTER_GAUGE: ("queue",),
}
Combination = tuple[str, str, str, str]


class TokenRevoked(Exception):
    """The provider refused the tool's credentials (class ``auth``: never retried)."""

    failure_class = "auth"


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    """Tools that always fail: ValueError (``unknown``, not retryable), TokenRevoked
    (``auth``), ConnectionError (``connection``, retried until the budget is spent)."""
    app = make_app()
    errors: dict[str, Callable[[str], Exception]] = {
        "value": lambda key: ValueError(f"provider rejected {key}"),
        "auth": lambda key: TokenRevoked(f"token revoked for {key}"),
        "connection": lambda key: ConnectionError(f"provider unreachable for {key}"),
    }
    for effect in ToolEffect:
        for kind, error in errors.items():
            def body(key: str, error: Callable[[str], Exception] = error) -> str:
                raise error(key)

            app.task(base=ToolTask, effect=effect, name=f"metrics.{kind}.{effect.value}",
                     shared=False)(body)
    return app


@contextmanager
def worker_on(app: Celery, *queues: str) -> Iterator[Any]:
    """An in-process worker (threads pool) consuming ``queues``."""
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                      loglevel="WARNING", shutdown_timeout=15, queues=list(queues)) as worker:
        yield worker


def dead_letter(app: Celery, name: str, queue: str) -> DeadLetter:
    """Send ``name`` to ``queue`` and wait until it is a dead letter."""
    result = app.send_task(name, args=[uuid.uuid4().hex[:8]], queue=queue,
                           headers={"tooleffect_run_id": f"run-{uuid.uuid4().hex[:8]}"})
    letters = DeadLetters(app)
    found = wait_for(lambda: letters.get(result.id), timeout=60,
                     what=f"{name}[{result.id}] to be dead-lettered")
    assert found is not None
    return found


def scrape(flower: FlowerProcess, app: Celery,
           made: list[DeadLetter]) -> dict[str, dict[tuple[str, ...], float]]:
    """The dead-letter gauges' samples on Flower's /metrics, by their labels.

    Checks the oldest-age gauge on the way: one sample per queue that still has
    one of the letters ``made`` (the only letters there are), at least how long
    ago the oldest of them was stored before the scrape, at most after it.
    """
    before = time.time()
    status, text = _request(f"{flower.url}/metrics")
    assert status == 200, text
    found: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in LABELS}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.name in LABELS:
            assert family.type == "gauge"
            for sample in family.samples:
                assert set(sample.labels) == set(LABELS[family.name]), sample
                found[family.name][tuple(sample.labels[label]
                                         for label in LABELS[family.name])] = sample.value
    after = time.time()
    assert APPROVALS_GAUGE in names and any(name.startswith("flower_") for name in names)
    # The oldest letter's age, per queue: now minus when it was stored.
    oldest: dict[str, float] = {}
    for letter in made:
        if DeadLetters(app).get(letter.task_id) is not None:
            oldest[letter.queue] = min(oldest.get(letter.queue, after), letter.dead_lettered_at)
    assert set(found[OLDEST_DEAD_LETTER_GAUGE]) == {(queue,) for queue in oldest}
    for queue, stored_at in oldest.items():
        age = found[OLDEST_DEAD_LETTER_GAUGE][(queue,)]
        assert before - stored_at <= age <= after - stored_at + 0.001, (queue, age)
    return found



def cli_stats(app: Celery) -> dict[str, Any]:
    """``celery -A <app> tooleffect dlq stats --json``, in this process."""
    result = CliRunner().invoke(
        tooleffect, ["dlq", "stats", "--json"],
        obj=CLIContext(app=app, no_color=True, workdir=None),
    )
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def by_combination(stats: dict[str, Any]) -> dict[Combination, float]:
    return {(row["queue"], row["reason"], row["failure_class"], row["effect"]):
            float(row["count"]) for row in stats["by_combination"]}


def test_dead_letter_gauges_on_flowers_metrics_agree_with_dlq_stats(
    app: Celery, start_flower: Callable[..., FlowerProcess]
) -> None:
    made: list[DeadLetter] = []
    with worker_on(app, "tools", "reports"):
        made.append(dead_letter(app, "metrics.value.read_only", "tools"))
        made.append(dead_letter(app, "metrics.value.read_only", "tools"))
        made.append(dead_letter(app, "metrics.auth.non_idempotent_write", "tools"))
        made.append(dead_letter(app, "metrics.connection.read_only", "reports"))
        made.append(dead_letter(app, "metrics.value.idempotent_write", "reports"))
        made.append(dead_letter(app, "metrics.no_such_tool", "reports"))
    expected: dict[Combination, float] = {
        ("tools", "not_retryable", "unknown", "read_only"): 2.0,
        ("tools", "not_retryable", "auth", "non_idempotent_write"): 1.0,
        ("reports", "retries_exhausted", "connection", "read_only"): 1.0,
        ("reports", "not_retryable", "unknown", "idempotent_write"): 1.0,
        ("reports", "unknown_task", "client_error", "non_idempotent_write"): 1.0,
    }
    assert {(letter.queue, letter.reason, letter.failure_class, letter.effect)
            for letter in made} == set(expected)

    flower = start_flower()
    gauges = scrape(flower, app, made)
    assert set(gauges[OLDEST_DEAD_LETTER_GAUGE]) == {("tools",), ("reports",)}

    # The gauge is the joint counts, as dlq stats --json (and DeadLetterOperations) says.
    stats = cli_stats(app)
    assert gauges[DEAD_LETTERS_GAUGE] == by_combination(stats) == expected
    assert by_combination(DeadLetterOperations(app).stats().to_dict()) == expected
    # ... and its sums are the per-facet counts (the sizes of the indexes).
    for position, facet in enumerate(("by_queue", "by_reason", "by_failure_class",
                                      "by_effect")):
        sums: dict[str, float] = {}
        for combination, count in expected.items():
            sums[combination[position]] = sums.get(combination[position], 0.0) + count
        assert sums == stats[facet], facet
    assert sum(expected.values()) == stats["total"] == len(made)

    # A purge takes one from its combination (and a combination at 0 has no sample).
    operations = DeadLetterOperations(app)
    first_tools = min((letter for letter in made if letter.queue == "tools"),
                      key=lambda letter: letter.dead_lettered_at)
    assert first_tools.effect == "read_only"
    purged = operations.purge(first_tools.task_id, actor="metrics-test", reason="test")
    assert purged.outcome is Outcome.DONE, purged.message
    gauges = scrape(flower, app, made)  # the tools queue's oldest is now its second letter
    expected[("tools", "not_retryable", "unknown", "read_only")] -= 1
    assert gauges[DEAD_LETTERS_GAUGE] == by_combination(cli_stats(app)) == expected
    auth = next(letter for letter in made if letter.failure_class == "auth")
    assert operations.purge(auth.task_id, actor="metrics-test").outcome is Outcome.DONE
    gauges = scrape(flower, app, made)
    del expected[("tools", "not_retryable", "auth", "non_idempotent_write")]
    assert gauges[DEAD_LETTERS_GAUGE] == by_combination(cli_stats(app)) == expected

    # Every letter gone: no dead-letter samples at all (absent, not 0).
    for letter in made:
        operations.purge(letter.task_id, actor="metrics-test")
    gauges = scrape(flower, app, made)
    assert gauges == {DEAD_LETTERS_GAUGE: {}, OLDEST_DEAD_LETTER_GAUGE: {}}
    assert cli_stats(app)["by_combination"] == []


# -- the joint counts in the store --------------------------------------------------------


def letter_of(queue: str, reason: str = "not_retryable", failure_class: str = "unknown",
              effect: str = "read_only") -> DeadLetter:
    return DeadLetter(task_id=uuid.uuid4().hex, name="metrics.tool", queue=queue,
                      reason=reason, failure_class=failure_class, effect=effect)


def test_joint_counts_never_go_below_zero_for_letters_stored_without_them(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    letters = DeadLetters(make_app())
    counts_key = letters.keys.dead_letter_counts
    # Letters written by a release without the joint counts: in the indexes only.
    legacy_a, legacy_b = letter_of("tools"), letter_of("tools", effect="idempotent_write")
    assert letters.store(legacy_a) and letters.store(legacy_b)
    main_redis.delete(counts_key)
    assert letters.counts() == [] and letters.stats().total == 2

    # A queue name holding what a separator might be is still one field.
    odd = 'q,"x"\x1f:y'
    counted, other = letter_of("tools"), letter_of(odd, "unknown_task", "client_error")
    assert letters.store(counted) and letters.store(other)
    assert letters.counts() == [
        DeadLetterCount("q,\"x\"\x1f:y", "unknown_task", "client_error", "read_only", 1),
        DeadLetterCount("tools", "not_retryable", "unknown", "read_only", 1),
    ]
    assert letters.stats().by_combination == letters.counts()
    assert not letters.store(counted)  # the first letter of a task wins: counted once
    assert len(letters.counts()) == 2

    # Removing a letter never counted takes nothing below 0: its own field stays absent.
    assert letters.remove(legacy_b.task_id) is not None
    assert len(main_redis.hgetall(counts_key)) == 2
    # One of a combination that has a count takes it down (the count cannot tell
    # them apart), and the next removal of that combination leaves it absent, not -1.
    assert letters.remove(legacy_a.task_id) is not None
    assert letters.remove(counted.task_id) is not None
    assert letters.counts() == [DeadLetterCount(odd, "unknown_task", "client_error",
                                                "read_only", 1)]
    assert all(int(value) > 0 for value in main_redis.hgetall(counts_key).values())

    # A replay's take moves the letter out (and out of the counts); put_back returns it.
    taken = letters.take(other.task_id)
    assert taken is not None and letters.counts() == []
    assert main_redis.exists(counts_key) == 0
    assert letters.put_back(taken)
    assert [row.count for row in letters.counts()] == [1]
    assert letters.remove(other.task_id) is not None
    assert letters.take(other.task_id) is None and letters.counts() == []
    assert letters.stats().total == 0 and letters.oldest() == {}


def test_oldest_reads_each_queues_first_score(make_app: Callable[..., Celery]) -> None:
    letters = DeadLetters(make_app())
    for queue, stored_at in [("a", 300.5), ("a", 100.25), ("b", 200.0), ("a", 400.0)]:
        letter = letter_of(queue)
        letter.dead_lettered_at = stored_at
        assert letters.store(letter)
    assert letters.oldest() == {"a": 100.25, "b": 200.0}


# -- a store that does not answer --------------------------------------------------------


def test_gauges_of_a_store_that_does_not_answer_are_absent_and_the_rest_is_served(
    make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture
) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    registry = CollectorRegistry()
    Gauge("other_metric", "Served whatever the store does.", registry=registry).set(7)

    def served() -> dict[str, list[Any]]:
        text = generate_latest(registry).decode()
        return {family.name: family.samples for family in text_string_to_metric_families(text)}

    # Dead letters on the broker's Redis, which does not answer; approvals in the store.
    letters_down = make_app(broker_url=nowhere, tooleffect_redis_url=REDIS_URL,
                            tooleffect_socket_timeout=0.5)
    export_store_gauges(Approvals(letters_down), DeadLetters(letters_down), registry=registry)
    with caplog.at_level(logging.WARNING, logger="celery_tooleffect.admin.flower.metrics"):
        families = served()
    assert [sample.value for sample in families["other_metric"]] == [7.0]
    assert families[APPROVALS_GAUGE] == []  # served: nothing pending
    assert DEAD_LETTERS_GAUGE not in families and OLDEST_DEAD_LETTER_GAUGE not in families
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert f"{DEAD_LETTERS_GAUGE} not served" in warned
    assert f"{OLDEST_DEAD_LETTER_GAUGE} not served" in warned
    assert f"{APPROVALS_GAUGE} not served" not in warned

    # Nothing answers: none of the store's gauges, the rest all the same. A second
    # export replaces the first collector.
    caplog.clear()
    all_down = make_app(broker_url=nowhere, tooleffect_redis_url=nowhere,
                        tooleffect_socket_timeout=0.5)
    export_store_gauges(Approvals(all_down), DeadLetters(all_down), registry=registry)
    with caplog.at_level(logging.WARNING, logger="celery_tooleffect.admin.flower.metrics"):
        families = served()
    assert [sample.value for sample in families["other_metric"]] == [7.0]
    assert not {APPROVALS_GAUGE, DEAD_LETTERS_GAUGE, OLDEST_DEAD_LETTER_GAUGE} & set(families)
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert all(f"{name} not served" in warned
               for name in (APPROVALS_GAUGE, DEAD_LETTERS_GAUGE, OLDEST_DEAD_LETTER_GAUGE))


# -- the Grafana dashboard -------------------------------------------------------------------


def panels_of(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows; rows themselves left out."""
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def test_grafana_dashboard_is_well_formed_and_queries_the_metrics() -> None:
    dashboard = json.loads(Path(DASHBOARD).read_text(encoding="utf-8"))
    assert [entry["name"] for entry in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    panels = list(panels_of(dashboard))
    assert panels
    ids = [panel["id"] for panel in dashboard["panels"]] + [
        panel["id"] for row in dashboard["panels"] for panel in row.get("panels", [])]
    assert len(ids) == len(set(ids))
    exprs: list[str] = []
    for panel in panels:
        assert panel.get("title"), panel
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel.get("targets"), panel["title"]
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), panel["title"]
            exprs.append(target["expr"])
    text = "\n".join(exprs)
    for metric in (DEAD_LETTERS_GAUGE, OLDEST_DEAD_LETTER_GAUGE, APPROVALS_GAUGE,
                   "gen_ai_execute_tool_duration_seconds_bucket",
                   "tooleffect_tool_outcomes_total", "tooleffect_audit_write_failures_total",
                   "tooleffect_lease_extensions_total"):
        assert metric in text, metric
    for grouped in ("by (reason)", "by (failure_class)", "by (queue)", "by (queue, tool)",
                    "by (tooleffect_outcome)", 'tooleffect_result="failed"'):
        assert grouped in text, grouped
    assert "histogram_quantile(0.5" in text and "histogram_quantile(0.99" in text


# -- who may read /metrics ------------------------------------------------------------------

USER = "ops:s3cret"


def _scrape(url: str, user: str | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(f"{url}/metrics")
    if user:
        request.add_header("Authorization",
                           "Basic " + base64.b64encode(user.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return (int(response.status), response.read().decode(),
                    {name.lower(): value for name, value in response.headers.items()})
    except urllib.error.HTTPError as error:
        return (int(error.code), error.read().decode(),
                {name.lower(): value for name, value in error.headers.items()})


def _families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_metrics_ask_for_flowers_basic_auth_unless_the_setting_opens_them(
    make_app: Callable[..., Celery], start_flower: Callable[..., FlowerProcess],
) -> None:
    """By default (``tooleffect_flower_metrics_auth`` True) Flower's /metrics, its own
    series and the package's, asks for the --basic-auth credentials; set to
    False, it answers anyone, as Flower alone does."""
    app = make_app()
    DeadLetters(app).store(DeadLetter(
        task_id=str(uuid.uuid4()), name="tools.write", queue="tools",
        reason="retries_exhausted", failure_class="connection",
        effect="non_idempotent_write", run_id="run-metrics", attempts=4))

    guarded = start_flower(f"--basic-auth={USER}")
    status, text, headers = _scrape(guarded.url)
    assert status == 401 and headers.get("www-authenticate") == 'Basic realm="flower"'
    assert DEAD_LETTERS_GAUGE not in text and "flower_" not in text
    assert _scrape(guarded.url, "ops:wrong")[0] == 401
    status, text, _ = _scrape(guarded.url, USER)
    assert status == 200, text
    families = _families(text)
    assert {DEAD_LETTERS_GAUGE, APPROVALS_GAUGE, OLDEST_DEAD_LETTER_GAUGE} <= families
    assert any(name.startswith("flower_") for name in families)  # Flower's own too

    opened = start_flower(f"--basic-auth={USER}", TE_FLOWER_METRICS_AUTH="0")
    status, text, _ = _scrape(opened.url)
    assert status == 200, text
    assert {DEAD_LETTERS_GAUGE, APPROVALS_GAUGE} <= _families(text)
    # The pages stay behind Flower's authentication either way.
    assert _request(f"{opened.url}/api/dead-letters")[0] == 401
    assert _request(f"{guarded.url}/api/dead-letters", user=USER)[0] == 200
