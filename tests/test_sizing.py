"""What a call leaves in the store, and what the operator is told of it (issue 40;
docs/redis.md#sizing-the-store), on a redis-server each test starts (it holds
nothing but the test's keys) and a real ``celery worker`` of tests/apps/tool_app.py.

The measurement prints its figures (run with ``-s`` to read them): they are
what docs/redis.md quotes. It asserts the targets of issue 40: with defaults, a
READ_ONLY call leaves at most 1,500 B and a write at most 2,000 B, counted both
as ``used_memory`` over the batch and as ``MEMORY USAGE`` of every key the call
left plus its share of the global stream.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celery_tooleffect import Approvals, DeadLetters
from celery_tooleffect.admin.cli import tooleffect
from celery_tooleffect.admin.flower.metrics import (
    BYTES_PER_CALL_GAUGE,
    CALL_RATE_GAUGE,
    KEYS_GAUGE,
    MAXMEMORY_GAUGE,
    PROJECTED_MEMORY_GAUGE,
    USED_MEMORY_GAUGE,
    export_store_gauges,
)
from celery_tooleffect.admin.sizing import (
    DEAD_LETTERS,
    GLOBAL_STREAM,
    JOURNAL,
    NOT_THE_PACKAGES,
    PER_CALL,
    RESULTS,
    ROLLBACK_WATCH,
    RUN_STREAMS,
    classify,
)
from celery_tooleffect.store.keys import Keys
from celery_tooleffect.testing import redis_server, wait_for
from tests.conftest import WorkerProcess

#: The tools of tests/apps/tool_app.py, one of each effect.
TOOLS = {"read_only": "tools.read", "idempotent_write": "tools.idempotent",
         "non_idempotent_write": "tools.write"}
#: Calls of each effect measured (TOOLEFFECT_TEST_SIZING_CALLS: more, for the
#: docs' figures), dead letters measured. Enough that a rehash of Redis's key
#: table during a batch (tens of kB at once) stays a few tens of bytes a call.
CALLS = int(os.environ.get("TOOLEFFECT_TEST_SIZING_CALLS") or 1000)
LETTERS = 200
#: redis-server options of the measurement's server (TOOLEFFECT_TEST_SIZING_REDIS_ARGS,
#: e.g. ``--stream-node-max-bytes 512``: the figures docs/redis.md quotes for it).
SERVER_ARGS = tuple(os.environ.get("TOOLEFFECT_TEST_SIZING_REDIS_ARGS", "").split())
#: Bytes a call may leave with defaults (issue 40), by effect.
TARGETS = {"read_only": 1_500, "idempotent_write": 2_000, "non_idempotent_write": 2_000}
#: One audit event as a stream would hold it (the fields of a READ_ONLY call's outcome).
EVENT = ["seq", "1", "run_id", "6f1c0a52-3a77-4b8e-9d0e-1f2a3b4c5d6e",
         "task_id", "6f1c0a52-3a77-4b8e-9d0e-1f2a3b4c5d6e", "tool", "tools.read",
         "effect", "READ_ONLY", "phase", "done", "status", "ok", "worker", "host:4242",
         "queue", "tools", "redelivered", "0", "ts", "1765000000.123456",
         "prev", "", "hash", "0123456789abcdef0123456789abcdef01234567"]


def memory(client: redis.Redis, keys: list[str]) -> dict[str, int]:
    """``MEMORY USAGE key SAMPLES 0`` (every element counted) of each key."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")  # type: ignore[no-untyped-call]
    return {key: int(used or 0) for key, used in zip(keys, pipe.execute(), strict=True)}


def names(client: redis.Redis) -> set[str]:
    return {key.decode() for key in client.scan_iter(count=1000)}


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def copied(client: redis.Redis, keys: Keys, events: int) -> Callable[[], bool]:
    """Whether the global stream holds ``events``: its copies are appended after
    each outcome, best effort."""
    return lambda: int(client.xlen(keys.global_events)) >= events


def call_all(app: Celery, tool: str, count: int, tag: str) -> None:
    """``count`` calls of ``tool``, each run (its result is its argument)."""
    sent = [(f"{tag}-{i}", app.send_task(tool, args=[f"{tag}-{i}"], queue="tools"))
            for i in range(count)]
    assert [result.get(timeout=120) for _, result in sent] == [key for key, _ in sent]


def test_bytes_per_call_by_effect_per_event_and_per_dead_letter(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess], prefix: str,
) -> None:
    with redis_server(*SERVER_ARGS) as server:
        app = make_app(broker_url=server.url, result_backend=server.url)
        client = server.client()
        keys = Keys(f"{prefix}te:")
        results_prefix = app.backend.get_key_for_task("x")[:-1].decode()
        spawn_worker(concurrency=2, broker_url=server.url)
        # The worker's own keys (queues, bindings, each process's rollback
        # watch, its declarations) come with the first calls, not with each.
        for tool in TOOLS.values():
            call_all(app, tool, 2, f"warm-up-{tool}")
        figures: dict[str, dict[str, Any]] = {}
        for effect, tool in TOOLS.items():
            before_keys, before_used = names(client), used_memory(client)
            before_global = memory(client, [keys.global_events])[keys.global_events]
            events_before = client.xlen(keys.global_events)
            call_all(app, tool, CALLS, effect)
            wait_for(copied(client, keys, events_before + CALLS), timeout=30,
                     what="the global stream's copies")
            new = sorted(names(client) - before_keys)
            kinds = Counter(classify(key, keys.prefix, results_prefix) for key in new)
            sizes = memory(client, new)
            by_kind: dict[str, int] = defaultdict(int)
            for key, size in sizes.items():
                by_kind[classify(key, keys.prefix, results_prefix)] += size
            # Every key a call leaves expires: none lives past the retention.
            ttls = dict(zip(new, [client.ttl(key) for key in new], strict=True))
            assert [key for key, ttl in ttls.items() if ttl < 0] == []
            # What each call leaves: its run's events (no run_id: a run of its
            # own; the chain's head in the same key), a journal entry for a
            # write, Celery's result.
            assert kinds[RUN_STREAMS] == CALLS
            assert kinds[JOURNAL] == (0 if effect == "read_only" else CALLS)
            assert kinds[RESULTS] == CALLS
            # A pool process marks the rollback watch with its first write: the
            # warm-up may have given both its writes to one of the two.
            assert kinds[ROLLBACK_WATCH] <= 2, kinds
            assert set(kinds) - {ROLLBACK_WATCH} <= {*PER_CALL, RESULTS}, kinds
            global_growth = (memory(client, [keys.global_events])[keys.global_events]
                             - before_global)
            events = client.xlen(keys.global_events) - events_before
            figures[effect] = {
                "keys_per_call": round(len(new) / CALLS, 2),
                "package_bytes_per_call": round(sum(by_kind[k] for k in PER_CALL) / CALLS),
                **{f"{kind}_per_call": round(by_kind[kind] / CALLS) for kind in
                   (RUN_STREAMS, JOURNAL, RESULTS)},
                "events_per_call": round(events / CALLS, 2),
                "global_stream_bytes_per_call": round(global_growth / CALLS),
                "used_memory_per_call": round((used_memory(client) - before_used) / CALLS),
            }
            figures[effect]["keys_bytes_per_call"] = (
                figures[effect]["package_bytes_per_call"]
                + figures[effect][f"{RESULTS}_per_call"]
                + figures[effect]["global_stream_bytes_per_call"])

        # Dead letters: unknown tools, each kept with its message.
        before_letters = [key for key in names(client)
                          if classify(key, keys.prefix) == DEAD_LETTERS]
        letters_before = sum(memory(client, before_letters).values())
        before_used = used_memory(client)
        for i in range(LETTERS):
            app.send_task("tools.missing", args=[f"letter-{i}"], queue="tools")
        wait_for(lambda: DeadLetters(app).stats().total >= LETTERS, timeout=60,
                 what="the dead letters")
        letters = [key for key in names(client) if classify(key, keys.prefix) == DEAD_LETTERS]
        letter_bytes = sum(memory(client, letters).values()) - letters_before
        # An unresolved dead letter never expires: its envelope has no TTL.
        assert client.ttl(keys.dead_letters("tools")) == -1
        global_bytes = memory(client, [keys.global_events])[keys.global_events]
        figures["dead_letter"] = {
            "bytes_per_letter": round(letter_bytes / LETTERS),
            "used_memory_per_letter": round((used_memory(client) - before_used) / LETTERS)}
        figures["global_stream"] = {
            "events": client.xlen(keys.global_events),
            "bytes_per_event": round(global_bytes / client.xlen(keys.global_events))}
        print("\nSIZING", json.dumps(figures, indent=2))
        for effect, target in TARGETS.items():
            assert 0 < figures[effect]["keys_bytes_per_call"] <= target, (effect, figures[effect])
            assert figures[effect]["used_memory_per_call"] <= target, (effect, figures[effect])
        assert figures["dead_letter"]["bytes_per_letter"] > 0


def test_a_run_stream_costs_its_preallocated_node_not_its_entries() -> None:
    # Why a call without a run_id costs kilobytes: Redis 7 allocates a stream's
    # first node (a listpack) at stream-node-max-bytes (4096 by default) up
    # front, whatever it holds; a list holding the same event grows with it.
    with redis_server() as server:
        client = server.client()
        client.xadd("stream", dict(zip(EVENT[::2], EVENT[1::2], strict=True)))
        client.rpush("list", "|".join(EVENT))
        stream, listed = memory(client, ["stream", "list"]).values()
        assert stream > 4096 > 4 * listed, (stream, listed)
        # The same node at a smaller stream-node-max-bytes: the operator's lever.
        client.config_set("stream-node-max-bytes", 512)
        client.xadd("small", dict(zip(EVENT[::2], EVENT[1::2], strict=True)))
        assert memory(client, ["small"])["small"] < 1300 < stream


def test_the_store_command_and_the_gauges_report_the_sizing(
    make_app: Callable[..., Celery], spawn_worker: Callable[..., WorkerProcess], prefix: str,
) -> None:
    # A maxmemory the projection passes: 7 days of even a few calls a second.
    with redis_server("--maxmemory", "64mb", "--maxmemory-policy", "noeviction") as server:
        app = make_app(broker_url=server.url, result_backend=server.url)
        client = server.client()
        spawn_worker(concurrency=2, broker_url=server.url)
        for effect, tool in TOOLS.items():
            call_all(app, tool, 20, effect)
        keys = Keys(f"{prefix}te:")
        wait_for(copied(client, keys, 60), timeout=30, what="the global stream's copies")
        for i in range(3):
            app.send_task("tools.missing", args=[f"letter-{i}"], queue="tools")
        wait_for(lambda: DeadLetters(app).stats().total == 3, timeout=30,
                 what="the dead letters")
        # A letter is stored before its refusal's audit event is appended:
        # wait for every run's events too.
        wait_for(lambda: sum(1 for _ in client.scan_iter(
            match=f"{prefix}te:{{*}}:events", count=1000)) == 63,
            timeout=30, what="every call's and letter's run events")

        shown = invoke(app, "store", "--sizing", "--json")
        assert shown.exit_code == 0, shown.output
        sizing = json.loads(shown.stdout)["sizing"]
        assert sizing["maxmemory"] == 64 * 1024 * 1024
        assert 0 < sizing["used_memory"] < sizing["maxmemory"]
        assert sizing["complete"] is True and sizing["scanned"] == sizing["total_keys"]
        kinds = {row["kind"]: row for row in sizing["kinds"]}
        # Each call and each letter (its refusal is audited) is a run of its own.
        assert kinds[RUN_STREAMS]["keys"] == 63
        assert kinds[JOURNAL]["keys"] == 40  # the writes' entries
        assert kinds[RESULTS]["keys"] == 63  # a letter's result says why it failed
        assert kinds[GLOBAL_STREAM]["keys"] == 1 and kinds[GLOBAL_STREAM]["bytes"] > 0
        assert all(row["without_ttl"] == 0 for row in sizing["kinds"] if row["kind"] in PER_CALL)
        # The broker's queues are the broker's, not the package's.
        assert kinds[NOT_THE_PACKAGES]["keys"] > 0 and kinds[NOT_THE_PACKAGES]["bytes"] == 0
        effects = {row["effect"]: row for row in sizing["effects"]}
        # An unknown tool's call is audited as what it may be: a non-idempotent write.
        assert {name: row["calls"] for name, row in effects.items()} == {
            "read_only": 20, "idempotent_write": 20, "non_idempotent_write": 23}
        assert all(row["bytes_per_call"] > 0 for row in effects.values())
        # A write leaves a journal entry a read does not.
        assert effects["read_only"]["bytes_per_call"] < effects["non_idempotent_write"][
            "bytes_per_call"]
        letters = sizing["dead_letters"]
        assert (letters["letters"], letters["in_the_store"]) == (3, True)
        assert letters["bytes_per_letter"] > 0 and kinds[DEAD_LETTERS]["bytes"] == letters["bytes"]
        assert sizing["results"]["calls"] == 63 and sizing["results"]["bytes_per_call"] > 0
        assert sizing["events_per_call"] >= 1 and sizing["bytes_per_global_event"] > 0
        assert sizing["calls_per_second"] > 0
        assert sizing["retention_seconds"] == 7 * 24 * 3600
        # 60 calls within the last seconds: a rate that fills 64 MB within 7 days.
        assert sizing["projected_memory"] > sizing["maxmemory"]
        assert any("more than its maxmemory" in warning for warning in sizing["warnings"])

        said = invoke(app, "store", "--sizing", width=120).stdout
        assert f"Sizing of the store 127.0.0.1:{server.port}: used memory" in said
        assert "maxmemory 67.1 MB (policy noeviction)" in said
        for line in ("run events", "journal entries", "celery results", "read_only",
                     "idempotent_write", "non_idempotent_write", "(Celery result)",
                     "a call's keys live 7 days", "Dead letters: 3, ", "Projected memory:",
                     "WARNING: at "):
            assert line in said, line
        # A sample smaller than the store: extrapolated, and said so.
        small = json.loads(invoke(app, "store", "--sizing", "--json", "--sample", "50",
                                  "--runs", "5").stdout)["sizing"]
        assert small["scanned"] <= 50 and small["complete"] is False
        assert any("extrapolated" in warning for warning in small["warnings"])
        assert sum(row["calls"] for row in small["effects"]) <= 5
        assert invoke(app, "store", "--sizing", "--sample", "0").exit_code == 2

        registry = CollectorRegistry()
        gauges = export_store_gauges(Approvals(app), DeadLetters(app), registry=registry)
        scraped = scrape(registry)
        assert scraped[MAXMEMORY_GAUGE][()] == 64 * 1024 * 1024
        assert scraped[USED_MEMORY_GAUGE][()] > 0
        assert scraped[PROJECTED_MEMORY_GAUGE][()] > 64 * 1024 * 1024
        assert scraped[CALL_RATE_GAUGE][()] > 0
        assert set(scraped[BYTES_PER_CALL_GAUGE]) == {(("effect", e),) for e in TOOLS}
        assert scraped[KEYS_GAUGE][((("kind", RUN_STREAMS),))] == 63
        # Cached between scrapes: more calls change nothing until it is measured again.
        events = int(client.xlen(keys.global_events))
        call_all(app, "tools.read", 5, "more")
        wait_for(copied(client, keys, events + 5), timeout=30, what="the global stream's copies")
        assert scrape(registry)[KEYS_GAUGE][((("kind", RUN_STREAMS),))] == 63
        gauges.sizing_ttl = 0
        assert scrape(registry)[KEYS_GAUGE][((("kind", RUN_STREAMS),))] == 68


def scrape(registry: CollectorRegistry) -> dict[str, dict[tuple[Any, ...], float]]:
    found: dict[str, dict[tuple[Any, ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return found


def invoke(app: Celery, *args: str, width: int = 80) -> Result:
    return CliRunner().invoke(tooleffect, list(args),
                              obj=CLIContext(app=app, no_color=True, workdir=None),
                              env={"COLUMNS": str(width)})


def test_a_store_without_calls_projects_what_it_holds(make_app: Callable[..., Celery]) -> None:
    with redis_server() as server:
        app = make_app(broker_url=server.url, result_backend=server.url)
        sizing = json.loads(invoke(app, "store", "--sizing", "--json").stdout)["sizing"]
        assert sizing["effects"] == [] and sizing["calls_per_second"] == 0
        assert sizing["maxmemory"] == 0 and sizing["warnings"] == []
        # Nothing comes: the projection is what is there.
        assert sizing["projected_memory"] <= sizing["used_memory"]
        said = invoke(app, "store", "--sizing").stdout
        assert "no maxmemory" in said and "Bytes per call: no run to measure." in said
