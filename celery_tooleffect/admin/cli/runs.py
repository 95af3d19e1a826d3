"""``runs``: one agent run's calls in the order they started (``show``)."""

from __future__ import annotations

import sys

import click

from ..runs import PAGE_SIZE, Runs
from ..table import render
from .base import (
    EXIT_REFUSED,
    NEEDS_STORE,
    ToolEffectGroup,
    app_of,
    echo_json,
    fail,
    when,
    wide_option,
)


@click.group(cls=ToolEffectGroup)
def runs() -> None:
    """Agent runs: show every call of one run, from its audit trail."""


@runs.command("show", needs=NEEDS_STORE)
@click.argument("run_id")
@click.option("--cursor", help="Start at this page (the next_cursor of the page before).")
@click.option("--limit", type=click.IntRange(1, 5000), default=PAGE_SIZE, show_default=True,
              help="Calls per page.")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"run_id", "calls": [...], "next_cursor", "events_read"} '
                   "(see docs/operations.md#a-runs-calls).")
@wide_option
@click.pass_context
def runs_show(ctx: click.Context, run_id: str, cursor: str | None, limit: int,
              as_json: bool, wide: bool) -> None:
    """Show the calls of one run in the order they started: effect, state,
    how many times their bodies ran (RUNS: every attempt, replays included),
    how long they ran, how they ended."""
    page = Runs(app_of(ctx)).page(run_id, cursor=cursor, limit=limit)
    if as_json:
        echo_json(page.to_dict())
        if not page.calls:
            sys.exit(EXIT_REFUSED)
        return
    if not page.calls:
        fail(f"{run_id}: no audit events for this run")
    rows = [
        [when(call.first_ts), call.task_id, call.tool, call.effect, call.state,
         str(call.bodies or "-"), f"{call.duration_ms:.1f}" if call.spans else "-",
         call.dead_letter_reason or call.failure_class or call.last]
        for call in page.calls
    ]
    click.echo(render(["STARTED (UTC)", "TASK ID", "TOOL", "EFFECT", "STATE", "RUNS", "RAN MS",
                       "OUTCOME"], rows, shrink=["TOOL", "OUTCOME"],
                      optional=["OUTCOME", "RAN MS", "RUNS", "EFFECT", "STARTED (UTC)"],
                      wide=wide, hint=True))
    if page.next_cursor:
        click.echo(f"\nmore: runs show {run_id} --cursor {page.next_cursor}")
