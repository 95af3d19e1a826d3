"""Tamper-evident audit (docs/operations.md#audit-verify): each run's events are
chained inside Redis, each event carries its writer's keyed MAC when
``tooleffect_audit_key`` is set, and a head exported earlier pins the chain.

Every tampering is done on the real list in Redis: once naively (the stored
sums and links left as they were), once as someone who can write to Redis and
recomputes everything that needs no key (sums, links, header). What each check
detects, and what it cannot, is asserted both ways.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_tooleffect import AuditLog, ToolEffect, ToolTask
from celery_tooleffect.admin.cli import tooleffect
from tests.support import join_items, run_list, split_items

KEY = "an audit key of 32 bytes or more!"


def make_run(app: Celery, run_id: str) -> AuditLog:
    @app.task(base=ToolTask, name="tools.write", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def write(n: int) -> int:
        return n

    for n in range(3):  # three calls of one run: six events
        write.apply((n,), headers={"tooleffect_run_id": run_id})
    return AuditLog(app)


def cli(app: Celery, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(tooleffect, ["audit", *args],
                                obj=CLIContext(app=app, no_color=True, workdir=None))
    return result.exit_code, result.output


def bodies(client: redis.Redis, key: str) -> list[bytes]:
    """The run's events as stored, without their two sums."""
    return [element[16:] for element in run_list(client, key)[1]]


def edited(body: bytes, name: bytes, value: bytes) -> bytes:
    """``body`` with the stored field ``name`` set to ``value``."""
    items = [(stored, value if stored == name else old)
             for stored, old in split_items(b"0" * 16 + body)]
    return join_items(b"", items)


def recomputed(client: redis.Redis, key: str, new: list[bytes]) -> None:
    """Store ``new`` as the run's events with every unkeyed part recomputed, as
    the store would have: each sum and link, and the header."""
    link, elements = "", []
    for body in new:
        link = hashlib.sha1(link.encode() + body).hexdigest()
        elements.append(hashlib.sha1(body).hexdigest()[:8].encode() + link[:8].encode() + body)
    client.delete(key)
    client.rpush(key, f"te1 {len(new)} {link or '-'} 0 -".encode(), *elements)


def naive(client: redis.Redis, key: str, stored: tuple[bytes, list[bytes]],
          new: list[bytes]) -> None:
    """Store ``new`` under the header of ``stored`` (a run's list as read
    before), each body with the sums it had there (a new body: zeros)."""
    header, elements = stored
    sums = {element[16:]: element[:16] for element in elements}
    client.delete(key)
    client.rpush(key, header, *[sums.get(body, b"0" * 16) + body for body in new])


def test_an_untouched_chain_verifies(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    audit = make_run(app, "run-ok")
    check = audit.verify("run-ok")
    assert check.intact and check.events == 6 and check.keyed == 0
    events = audit.events("run-ok")
    assert events[0]["prev"] == ""
    assert all(b["prev"] == a["hash"] for a, b in itertools.pairwise(events))
    assert (check.head_seq, check.head) == (6, events[-1]["hash"]) == audit.head("run-ok")


# -- naive tampering: the chain alone finds it, with or without the key ------------


@pytest.mark.parametrize("key", [None, KEY], ids=["unkeyed", "keyed"])
def test_naive_tampering_breaks_the_chain_where_it_happened(
    make_app: Callable[..., Celery], main_redis: redis.Redis, key: str | None,
) -> None:
    app = make_app(tooleffect_audit_key=key)
    audit = make_run(app, "run-naive")
    name = audit.keys.run_events("run-naive")
    original = bodies(main_redis, name)
    stored = run_list(main_redis, name)
    assert audit.verify("run-naive").keyed == (6 if key else 0)

    def found(new: list[bytes]) -> tuple[str | None, str | None]:
        naive(main_redis, name, stored, new)
        check = audit.verify("run-naive")
        naive(main_redis, name, stored, original)
        assert audit.verify("run-naive").intact
        return check.broken_at, check.problem

    altered = edited(original[2], b"s", b"failed")
    assert found([*original[:2], altered, *original[3:]]) == ("3", "event was altered")
    assert found([*original[:3], *original[4:]]) == (
        "4", "the event before it is missing or was altered")
    assert found(original[:-1]) == ("end", "newer events were deleted")
    assert found([original[0], original[2], original[1], *original[3:]]) == (
        "2", "the event before it is missing or was altered")
    # An event copied from elsewhere in the run (its own sums kept).
    assert found([*original[:4], original[1], *original[4:]])[0] == "5"


# -- a writer of Redis who recomputes what needs no key ------------------------------


def test_without_the_key_a_recomputed_chain_verifies(
    make_app: Callable[..., Celery], main_redis: redis.Redis,
) -> None:
    # What the docs say cannot be detected without the key or an exported head.
    app = make_app()
    audit = make_run(app, "run-open")
    name = audit.keys.run_events("run-open")
    original = bodies(main_redis, name)
    forged = edited(original[1], b"s", b"failed")
    for new in ([original[0], forged, *original[2:]],  # edit
                [*original[:3], *original[4:]],  # deletion
                original[:4],  # truncation
                [original[0], original[2], original[1], *original[3:]],  # reordering
                [*original[:2], edited(original[0], b"T", b"1.0"), *original[2:]]):  # insertion
        recomputed(main_redis, name, new)
        assert audit.verify("run-open").intact


def test_with_the_key_edits_and_forged_events_are_found(
    make_app: Callable[..., Celery], main_redis: redis.Redis,
) -> None:
    app = make_app(tooleffect_audit_key=KEY)
    audit = make_run(app, "run-keyed")
    name = audit.keys.run_events("run-keyed")
    original = bodies(main_redis, name)
    # Every event carries its writer's MAC (the intent's and the outcome's).
    assert all(event.mac is not None and len(event.mac) == 22
               for event in audit.events("run-keyed"))

    def found(new: list[bytes]) -> tuple[str | None, str | None]:
        recomputed(main_redis, name, new)
        check = audit.verify("run-keyed")
        return check.broken_at, check.problem

    mac_broken = "event was altered or forged: its MAC does not match"
    # An edit, with sums, links and header recomputed: its MAC does not match.
    assert found([original[0], edited(original[1], b"s", b"failed"), *original[2:]]) == (
        "2", mac_broken)
    # A forged event: new content under a made-up MAC, or none.
    invented = edited(original[0], b"T", b"1796000000.000001")
    assert found([*original[:2], invented, *original[2:]]) == ("3", mac_broken)
    without_mac = join_items(b"", [(n, v) for n, v in split_items(b"0" * 16 + original[0])
                                   if n != b"m"])
    assert found([*original[:2], without_mac, *original[2:]]) == (
        "3", "event has no MAC: not stored by a holder of the audit key")
    # A genuine event stored twice.
    assert found([*original[:3], original[0], *original[3:]]) == (
        "4", "event repeats event 1")
    # An event moved from another run: its MAC names its run.
    other = make_run(app, "run-other")
    moved = bodies(main_redis, other.keys.run_events("run-other"))[0]
    assert found([*original, moved]) == ("7", mac_broken)
    # What the key alone cannot find (documented): whole calls removed,
    # truncated or reordered, the chain recomputed; the exported head finds
    # them (below).
    for new in ([*original[:2], *original[4:]], original[:4],
                [*original[2:4], *original[:2], *original[4:]]):
        assert found(new) == (None, None)
    # An outcome moved away from its intent reads as another task's: found.
    assert found([original[0], original[2], original[1], *original[3:]]) == ("3", mac_broken)
    # An app without the key does not check MACs, and says so.
    recomputed(main_redis, name, original)
    plain = AuditLog(make_app())
    assert plain.verify("run-keyed").intact and plain.verify("run-keyed").keyed == 0
    # An app with the key finds a run stored without it.
    make_run(make_app(), "run-unkeyed")
    assert audit.verify("run-unkeyed").problem == (
        "event has no MAC: not stored by a holder of the audit key")


@pytest.mark.parametrize("key", [None, KEY], ids=["unkeyed", "keyed"])
def test_an_exported_head_finds_any_change_up_to_it(
    make_app: Callable[..., Celery], main_redis: redis.Redis, key: str | None,
) -> None:
    app = make_app(tooleffect_audit_key=key)
    audit = make_run(app, "run-head")
    name = audit.keys.run_events("run-head")
    original = bodies(main_redis, name)
    code, output = cli(app, "head", "run-head")
    assert code == 0
    run_id, head = output.split()
    seq, link = head.split(":")
    assert run_id == "run-head" and (int(seq), link) == audit.head("run-head")
    exported = (int(seq), link)
    assert audit.verify("run-head", head=exported).intact
    changed = "the chain differs from the exported head: an event up to it was altered, " \
              "removed, moved or inserted"
    mac_broken = "event was altered or forged: its MAC does not match"

    def found(new: list[bytes]) -> tuple[str | None, str | None]:
        recomputed(main_redis, name, new)
        check = audit.verify("run-head", head=exported)
        return check.broken_at, check.problem

    # An edit: the key finds it at the event, the head at its seq.
    assert found([original[0], edited(original[1], b"s", b"failed"), *original[2:]]) == (
        ("2", mac_broken) if key else ("6", changed))
    # Whole calls reordered: not by the key, by the head.
    assert found([*original[2:4], *original[:2], *original[4:]]) == ("6", changed)
    # An insertion: the key finds a forged event, the head any.
    assert found([*original[:2], edited(original[0], b"T", b"1.0"), *original[2:]]) == (
        ("3", mac_broken) if key else ("6", changed))
    # A genuine event stored twice: found as such, with or without the key.
    assert found([*original[:4], original[0], *original[4:]]) == (
        "5", "event repeats event 1")
    # A deletion (and a truncation): the run no longer reaches the head.
    ends = ("end", "the run ends before the exported head (seq 6): events were deleted")
    assert found([*original[:2], *original[4:]]) == ends
    assert found(original[:4]) == ends
    main_redis.delete(name)
    assert audit.verify("run-head", head=exported).problem == (
        "the run has no events, the exported head names seq 6: they were deleted")
    # Events appended after the export do not matter to it.
    recomputed(main_redis, name, original)
    make_run(app, "run-head")
    assert audit.verify("run-head", head=exported).intact
    code, output = cli(app, "verify", "run-head", "--head", head)
    assert code == 0 and "leads to the exported head" in output
    code, output = cli(app, "verify", "run-head", "--head", f"3:{link}")
    assert code == 1 and "BROKEN at 3: the chain differs from the exported head" in output
    assert cli(app, "verify", "run-head", "--head", "x:y")[0] == 2
    assert cli(app, "head", "no-such-run") == (1, "no-such-run: no events\n")


def test_the_cli_verifies_one_run_or_all(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    app = make_app()
    audit = make_run(app, "run-{a}")
    make_run(app, "run-b")
    code, output = cli(app, "verify", "run-{a}")
    assert code == 0 and "run-{a}: intact (6 events, not keyed (no audit key set))" in output
    code, output = cli(app, "verify", "--all")
    assert code == 0 and "2 of 2 run(s) intact" in output
    main_redis.lrem(audit.keys.run_events("run-{a}"), 1,
                    run_list(main_redis, audit.keys.run_events("run-{a}"))[1][1])
    code, output = cli(app, "verify", "--all")
    assert code == 1 and "run-{a}: BROKEN at 2" in output and "run-b: intact" in output
    code, _ = cli(app, "verify")
    assert code == 2
    code, output = cli(make_app(tooleffect_audit_key=KEY), "verify", "run-b")
    assert code == 1 and "event has no MAC" in output


def test_trimming_moves_the_chain_s_base(make_app: Callable[..., Celery],
                                         main_redis: redis.Redis) -> None:
    app = make_app(tooleffect_run_stream_maxlen=2, tooleffect_audit_key=KEY)
    audit = make_run(app, "run-trim")
    # Six events, two kept (trimmed once past 2 + a tenth, rounded down).
    header, elements = run_list(main_redis, audit.keys.run_events("run-trim"))
    assert len(elements) == 2 and header.split()[1:2] == [b"6"]
    assert [event.seq for event in audit.events("run-trim")] == [5, 6]
    check = audit.verify("run-trim")
    assert check.intact and check.events == 2 and check.keyed == 2
    # A head that was trimmed away cannot be checked, and says so.
    assert audit.verify("run-trim", head=(2, "0" * 40)).problem == (
        "the exported head (seq 2) is no longer stored: trimmed, or deleted")
