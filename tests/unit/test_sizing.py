"""How the store's sizing names keys and projects memory
(celery_tooleffect/admin/sizing.py), without a server."""

from __future__ import annotations

from celery_tooleffect.admin.sizing import (
    APPROVALS,
    CLAIMS,
    DEAD_LETTERS,
    DECLARATIONS,
    GLOBAL_STREAM,
    JOURNAL,
    KINDS,
    NOT_THE_PACKAGES,
    OTHER_PACKAGE,
    RESULTS,
    ROLLBACK_WATCH,
    RUN_STREAMS,
    EffectSize,
    KindSize,
    LetterSize,
    Sizing,
    classify,
    human_bytes,
    measure_projection,
)
from celery_tooleffect.store.keys import Keys

KEYS = Keys("app:te:")


def test_every_key_of_the_key_table_has_its_kind() -> None:
    expected = {
        KEYS.journal("r1", "t1"): JOURNAL,
        KEYS.run_events("r1"): RUN_STREAMS,
        KEYS.approval("r1", "t1"): APPROVALS,
        KEYS.global_events: GLOBAL_STREAM,
        KEYS.dead_letters("tools"): DEAD_LETTERS,
        KEYS.dead_letter_index("tools"): DEAD_LETTERS,
        KEYS.dead_letter_all: DEAD_LETTERS,
        KEYS.dead_letter_facet("reason", "unknown_task"): DEAD_LETTERS,
        KEYS.dead_letter_counts: DEAD_LETTERS,
        KEYS.approvals_pending: APPROVALS,
        KEYS.approvals_decided("approved", queue="q"): APPROVALS,
        KEYS.call_claim("t1"): CLAIMS,
        KEYS.declared_effects: DECLARATIONS,
        KEYS.rollback: ROLLBACK_WATCH,
        KEYS.writer("host:1:abc"): ROLLBACK_WATCH,
        # Run ids that look like other keys stay runs: the tag is escaped.
        KEYS.run_events("events"): RUN_STREAMS,
        KEYS.journal("{dlq:tools}", "t1"): JOURNAL,
        KEYS.run_events("a}b:journal:x"): RUN_STREAMS,
        "app:te:something-new": OTHER_PACKAGE,
        "app:celery-task-meta-t1": RESULTS,
        "_kombu.binding.tools": NOT_THE_PACKAGES,
    }
    found = {key: classify(key, KEYS.prefix, "app:celery-task-meta-") for key in expected}
    assert found == expected
    assert set(expected.values()) <= set(KINDS)
    # Results elsewhere than the store are not counted as the store's.
    assert classify("app:celery-task-meta-t1", KEYS.prefix) == NOT_THE_PACKAGES


def sizing(**changes: object) -> Sizing:
    kinds = {kind: KindSize(kind) for kind in KINDS}
    kinds[RUN_STREAMS].bytes = 4_000_000
    kinds[JOURNAL].bytes = 400_000
    kinds[RESULTS].bytes = 300_000
    kinds[GLOBAL_STREAM].bytes = 330_000
    found = Sizing(
        server="s", used_memory=6_000_000, maxmemory=0, maxmemory_policy="noeviction",
        total_keys=3_000, scanned=3_000, kinds=kinds, dead_letters=LetterSize(),
        effects={"read_only": EffectSize("read_only", 500, 2_500_000),
                 "non_idempotent_write": EffectSize("non_idempotent_write", 500, 3_000_000)},
        results=EffectSize(RESULTS, 1_000, 300_000), events_per_call=1.5,
        bytes_per_global_event=330, calls_per_second=10.0, rate_window_seconds=100.0,
        retention_seconds=7 * 86400, result_expires_seconds=86400,
        global_stream_maxlen=100_000, projected_memory=0)
    for name, value in changes.items():
        setattr(found, name, value)
    return found


def test_the_projection_is_what_stays_plus_the_rate_over_each_lifetime() -> None:
    measured = sizing()
    # Fixed: 6 MB used less the per-call keys (4.4 MB), results, global stream.
    fixed = 6_000_000 - 4_400_000 - 300_000 - 330_000
    per_call = (2_500_000 + 3_000_000) / 1_000
    expected = (fixed + 10 * 7 * 86400 * per_call + 10 * 86400 * 300
                + 100_000 * 330)  # the global stream at its cap
    projected, warnings = measure_projection(measured)
    assert projected == round(expected)
    assert warnings == []  # no maxmemory: nothing to pass

    limited = sizing(maxmemory=1_000_000_000)
    projected, warnings = measure_projection(limited)
    assert projected > 1_000_000_000
    assert warnings == [
        f"at 10.00 calls/s for the retention (7 days) the store would need about "
        f"{human_bytes(projected)}, more than its maxmemory (1.0 GB): a full noeviction "
        "store fails every write closed; raise maxmemory or lower tooleffect_retention"]


def test_an_idle_store_projects_what_does_not_expire() -> None:
    idle = sizing(calls_per_second=0.0)
    projected, _ = measure_projection(idle)
    # The calls' keys and results expire, none come: the rest stays, the
    # global stream as it is (it is trimmed, not expired).
    assert projected == 6_000_000 - 4_400_000 - 300_000


def test_a_partial_sample_and_keys_without_ttl_are_said() -> None:
    partial = sizing(scanned=100)
    partial.kinds[JOURNAL].without_ttl = 2
    _, warnings = measure_projection(partial)
    assert warnings == ["keys without a TTL among the journal entries: they never expire",
                        "sampled 100 of 3000 keys: counts and bytes by kind are extrapolated"]


def test_bytes_read_as_people_do() -> None:
    assert [human_bytes(v) for v in (0, 999, 1_000, 1_536, 33_000_000_000, 5e15)] == [
        "0 B", "999 B", "1.0 kB", "1.5 kB", "33.0 GB", "5000.0 TB"]
