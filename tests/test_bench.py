"""The benchmark program works: ``python -m bench --smoke`` (a few hundred calls).

Benchmarks are not tests and nothing here is timed. The smoke run checks that
every phase runs to its end on real workers and a real Redis, that every call
ended in SUCCESS (the program fails otherwise), that the baseline really
fetches with kombu's ``BRPOP`` and every other row with the package's atomic
fetch, and that the round trips it counts are the design's (a count, not a
speed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TESTS

BASELINE = "plain celery, kombu's fetch"
PLAIN_ATOMIC = "plain celery, atomic fetch"
WRITES = ("IDEMPOTENT_WRITE", "NON_IDEMPOTENT_WRITE", "NON_IDEMPOTENT_WRITE + deadline")

# Round trips of one successful call, fetch to acknowledgement, derived from
# the commands each step sends (a MULTI/EXEC or a pipeline is one round trip,
# a script is one):
#
# - fetch: kombu's is BRPOP, then QoS.append (ZADD unacked_index + HSET
#   unacked in one MULTI): 2. The atomic fetch is one script: 1.
# - acknowledgement: ZREM + HDEL in one MULTI: 1, unless it rides in a store
#   script (only when the broker is the store's Redis).
# - Celery's result backend: GET of the stored meta, then SETEX + PUBLISH in
#   one pipeline: 2, unless the result rides in a store script (only when the
#   backend is the store's Redis).
# - the store: a read's audit append 1; a write's intent and outcome 2.
# - a deadline secures its broker lease before the body: 1 more on the broker,
#   unless it rides in the intent (broker = store's Redis).
#
# Per role (three proxies, three addresses: nothing can ride anywhere):
#   broker = fetch (2 kombu, 1 atomic) + ack 1 (+ lease 1 with a deadline)
#   backend = 2 for every row; store = 0 plain, 1 read, 2 write.
PER_ROLE = {
    BASELINE: {"broker": 2 + 1, "backend": 2, "store": 0},
    PLAIN_ATOMIC: {"broker": 1 + 1, "backend": 2, "store": 0},
    "READ_ONLY": {"broker": 1 + 1, "backend": 2, "store": 1},
    "IDEMPOTENT_WRITE": {"broker": 1 + 1, "backend": 2, "store": 2},
    "NON_IDEMPOTENT_WRITE": {"broker": 1 + 1, "backend": 2, "store": 2},
    "NON_IDEMPOTENT_WRITE + deadline": {"broker": 1 + 1 + 1, "backend": 2, "store": 2},
}
# One Redis for all three (one proxy): plain Celery folds nothing (kombu:
# 2 + 2 + 1 = 5; atomic: 1 + 2 + 1 = 4). A read's audit append carries the
# result and the ack: fetch 1 + append 1 = 2, fewer than plain Celery's. A
# write's intent carries the lease, its outcome the result and the ack:
# fetch 1 + intent 1 + outcome 1 = 3, no more than plain Celery's.
ONE_REDIS = {
    BASELINE: 2 + 2 + 1,
    PLAIN_ATOMIC: 1 + 2 + 1,
    "READ_ONLY": 1 + 1,
    "IDEMPOTENT_WRITE": 1 + 1 + 1,
    "NON_IDEMPOTENT_WRITE": 1 + 1 + 1,
    "NON_IDEMPOTENT_WRITE + deadline": 1 + 1 + 1,
}
# The smoke run's batches (40 and 200 calls) leave a few round trips of the
# atomic fetch's waits at a batch's end that do not cancel out (up to about
# 0.15 per call seen); under half a round trip, so an extra or a missing
# round trip still fails.
TOLERANCE = 0.3


@pytest.mark.timeout(400)
def test_the_benchmark_runs_every_phase_and_counts_the_round_trip_floor(tmp_path: Path) -> None:
    figures_file = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json", str(figures_file)],
        cwd=str(TESTS.parent), capture_output=True, text=True, timeout=380, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(figures_file.read_text())

    variants = figures["variants"]
    assert list(variants) == list(PER_ROLE)
    for name, variant in variants.items():
        assert len(variant["rounds"]) == 2 and all(r["calls"] == 100 for r in variant["rounds"])
        assert len(variant["latencies_ms"]) == 20
        trips = variant["round_trips"]
        for role, expected in PER_ROLE[name].items():
            assert abs(trips[role] - expected) < TOLERANCE, (name, role, trips)
        assert abs(trips["one redis"] - ONE_REDIS[name]) < TOLERANCE, (name, trips)

    # The baseline fetches with kombu's BRPOP (and records with QoS.append's
    # HSET); every other row with the atomic fetch's script, never BRPOP.
    commands = {name: variant["commands"] for name, variant in variants.items()}
    assert abs(commands[BASELINE].get("brpop", 0) - 1) < TOLERANCE, commands[BASELINE]
    assert commands[BASELINE].get("evalsha", 0) < TOLERANCE, commands[BASELINE]
    for name in list(PER_ROLE)[1:]:
        assert commands[name].get("brpop", 0) < TOLERANCE, (name, commands[name])
    assert abs(commands[PLAIN_ATOMIC].get("evalsha", 0) - 1) < TOLERANCE, commands[PLAIN_ATOMIC]

    # The round-trip targets, on one Redis: a read fewer than plain
    # Celery's (either fetch), a write no more.
    one = {name: variant["round_trips"]["one redis"] for name, variant in variants.items()}
    for plain in (BASELINE, PLAIN_ATOMIC):
        assert one["READ_ONLY"] <= one[plain] - 1 + TOLERANCE, one
        for name in WRITES:
            assert one[name] <= one[plain] + TOLERANCE, (name, one)
    targets = {entry["target"]: entry for entry in figures["targets"]}
    assert targets["READ_ONLY: round trips on one Redis fewer than the baseline's"]["met"]

    operations = [entry["operation"] for entry in figures["operations"]]
    assert any("dlq list" in operation for operation in operations)
    assert any("dlq replay --all" in operation for operation in operations)
    assert any("audit show" in operation for operation in operations)
    assert f"| {BASELINE} |" in done.stdout and f"| {PLAIN_ATOMIC} |" in done.stdout
    assert "| READ_ONLY |" in done.stdout and "ratio to baseline" in done.stdout
    assert "Targets (reported, not asserted)" in done.stdout

    # The pools matrix's smoke cell: threads, bodies that wait, the split
    # deployment; every variant ran its round and its waves.
    (cell,) = figures["pools"]
    assert (cell["pool"], cell["body"], cell["deployment"]) == (
        "threads", "waiting", "split databases")
    assert list(cell["rates"]) == ["plain Celery", "READ_ONLY", *WRITES]
    assert all(len(rates) == 1 for rates in cell["rates"].values())
    assert all(len(taken) == 2 * cell["concurrency"] for taken in cell["latencies_ms"].values())
    assert "| threads (20, 1) | waiting | split databases |" in done.stdout


def test_the_scripts_bench_measures_the_shipped_scripts_and_stubs_only_the_events() -> None:
    """``python -m bench.scripts``: both rows come from real script calls on its
    own server, and the stubbed row's scripts record the journal but no event."""
    from celery import Celery

    from bench.scripts import events_stubbed, one_round
    from celery_tooleffect.store.lua import script
    from celery_tooleffect.testing import redis_server

    with redis_server() as server:
        counted = {}
        for stub in (False, True):
            prefix = f"bst{int(stub)}:"
            app = Celery(f"bench-scripts-test-{int(stub)}", set_as_current=False)
            app.conf.update(broker_url=server.url, result_backend=server.url,
                            tooleffect_key_prefix=prefix, tooleffect_allow_volatile_store=True)
            client = server.client()
            if stub:
                with events_stubbed():
                    figures = one_round(app, 20)
            else:
                figures = one_round(app, 20)
            assert set(figures) == {"intent", "outcome"} and all(figures.values())
            counted[stub] = (len(client.keys(f"{prefix}*:journal:*")),
                             len(client.keys(f"{prefix}*:events")),
                             client.hlen(f"{prefix}unacked"),
                             len(client.keys(f"{prefix}celery-task-meta-*")))
        # Both: 20 journal entries moved, 20 results stored, 20 messages
        # acknowledged; only the shipped scripts stored events.
        assert counted[False] == (20, 20, 0, 20)
        assert counted[True] == (20, 0, 0, 20)
    # The stub is gone once the block ends.
    assert "if true then return {'0', 0} end" not in script("begin_attempt").text
