"""Tamper-evident audit: each event carries the hash of the one before it."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_tooleffect import AuditLog, ToolEffect, ToolTask
from celery_tooleffect.admin.cli import tooleffect


def make_run(app: Celery, run_id: str) -> AuditLog:
    @app.task(base=ToolTask, name="tools.write", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def write(n: int) -> int:
        return n

    for n in range(3):  # three calls of one run: six events
        write.apply((n,), headers={"tooleffect_run_id": run_id})
    return AuditLog(app)


def verify_cli(app: Celery, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        tooleffect, ["audit", "verify", *args],
        obj=CLIContext(app=app, no_color=True, workdir=None),
    )
    return result.exit_code, result.output


def test_an_untouched_chain_verifies(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    audit = make_run(app, "run-ok")
    check = audit.verify("run-ok")
    assert check.intact and check.events == 6
    events = audit.events("run-ok")
    assert events[0]["prev"] == ""
    assert all(b["prev"] == a["hash"] for a, b in itertools.pairwise(events))


def test_an_edited_event_is_the_first_broken_link(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    app = make_app()
    audit = make_run(app, "run-edit")
    # Each event's stored fields and entry id (an event read back is frozen).
    events = [dict(event) for event in audit.events("run-edit")]
    stream = audit.keys.run_events("run-edit")
    # Streams cannot be edited in place: rewrite the stream with the same ids
    # and one field of the third event changed.
    events[2]["status"] = "succeeded" if events[2]["status"] != "succeeded" else "failed"
    main_redis.delete(stream)
    for event in events:
        fields = {k: v for k, v in event.items() if k != "id"}
        main_redis.xadd(stream, fields, id=event["id"])  # type: ignore[arg-type]
    check = audit.verify("run-edit")
    assert check.broken_at == events[2]["id"] and check.problem == "event was altered"


def test_a_deleted_event_breaks_the_next_link(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    app = make_app()
    audit = make_run(app, "run-delete")
    events = audit.events("run-delete")
    main_redis.xdel(audit.keys.run_events("run-delete"), events[3]["id"])
    check = audit.verify("run-delete")
    assert check.broken_at == events[4]["id"]
    assert check.problem == "the event before it is missing or was altered"


def test_deleting_the_newest_event_is_caught_by_the_head(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    app = make_app()
    audit = make_run(app, "run-last")
    events = audit.events("run-last")
    main_redis.xdel(audit.keys.run_events("run-last"), events[-1]["id"])
    check = audit.verify("run-last")
    assert check.problem == "newer events were deleted"


def test_the_cli_verifies_one_run_or_all(
    make_app: Callable[..., Celery], main_redis: redis.Redis
) -> None:
    app = make_app()
    audit = make_run(app, "run-{a}")
    make_run(app, "run-b")
    code, output = verify_cli(app, "run-{a}")
    assert code == 0 and "run-{a}: intact (6 events)" in output
    code, output = verify_cli(app, "--all")
    assert code == 0 and "2 of 2 run(s) intact" in output
    main_redis.xdel(audit.keys.run_events("run-{a}"), audit.events("run-{a}")[1]["id"])
    code, output = verify_cli(app, "--all")
    assert code == 1 and "run-{a}: BROKEN at" in output and "run-b: intact" in output
    code, _ = verify_cli(app)
    assert code == 2
