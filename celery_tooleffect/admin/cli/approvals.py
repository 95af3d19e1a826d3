"""``approvals``: the calls that wait for a person's approval: list, show,
approve, reject, stats (:class:`~celery_tooleffect.admin.approvals.Approvals`).

Who decides is ``$TOOLEFFECT_ACTOR``, else ``user@host`` (``--by`` names
someone else); it is written in the audit event of every decision.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Mapping
from typing import Any

import click

from ...states import ApprovalState
from ...store.approvals import Approval
from ..approvals import Approvals
from ..filters import LISTED_APPROVAL_STATES
from ..operations import REASON_LIMIT, default_actor
from ..table import key_values, render, terminal_width
from ..visible import visible_json, warning
from .base import (
    NEEDS_STORE,
    ToolEffectGroup,
    app_of,
    echo_json,
    fail,
    report,
    runtime_of,
    when,
    wide_option,
)


@click.group(cls=ToolEffectGroup,
             short_help="Calls awaiting approval: list, show, approve, reject, stats.")
def approvals() -> None:
    """Calls that wait for a person's approval: list, show, approve, reject, stats."""


def _approvals(ctx: click.Context) -> Approvals:
    """The app's approvals, once the store answers."""
    runtime_of(ctx)
    return Approvals(app_of(ctx))


def _age(requested_at: float, now: float) -> str:
    """How long a call has waited: ``45s``, ``12m``, ``3h 05m``, ``2d 04h``."""
    seconds = max(int(now - requested_at), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600:02d}h"


def _arguments(arguments: Mapping[str, str]) -> str:
    """The arguments as ``tooleffect_privacy`` shows them (sizes at ``metadata``)."""
    return " ".join(f"{name}={value}" for name, value in arguments.items()) or "-"


def _state(approval: Approval, wanted: ApprovalState | None) -> str:
    """A row's state: a rejected or expired call a worker ended says both."""
    if wanted is not None and approval.state is ApprovalState.ENDED:
        return f"{wanted.value}, ended"
    return approval.state.value


@approvals.command("list", needs=NEEDS_STORE)
@click.option("--queue", "-Q", metavar="QUEUE", help="Only this queue.")
@click.option("--tool", "-t", metavar="NAME", help="Only this tool (task name).")
@click.option("--state", "-s", type=click.Choice(LISTED_APPROVAL_STATES),
              help="pending: the calls waiting for a decision. approved, rejected, expired: "
                   "the calls decided so within tooleffect_approval_retention (default 7 "
                   "days), newest decision first, also once their message was published "
                   "again.")
@click.option("--limit", "-n", type=click.IntRange(1, 1000), default=50, show_default=True,
              help="How many to show.")
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True,
              help="Skip this many first (the next page: --offset plus --limit).")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"approvals": [...], "count"} (stable, see '
                   "docs/operations.md#from-the-command-line).")
@wide_option
@click.pass_context
def approvals_list(ctx: click.Context, queue: str | None, tool: str | None,
                   state: str | None, limit: int, offset: int, as_json: bool,
                   wide: bool) -> None:
    """List the calls waiting for approval (and decided ones whose message is not
    published again yet), oldest first; with --state approved, rejected or
    expired, the calls decided so within tooleffect_approval_retention, newest
    decision first.

    The table keeps the task id and the tool whole at any width; the other
    columns are left out, least important first, when they do not fit
    (--wide prints them all).
    """
    operations = _approvals(ctx)
    wanted = ApprovalState.coerce(state) if state else None
    page = operations.listing(queue=queue or None, tool=tool or None, state=state or None,
                              limit=limit, offset=offset)
    if as_json:
        echo_json(page.to_dict())
        return
    found = page.approvals
    if not found:
        click.echo("No approvals match.")
        return
    now = time.time()
    # How long each call has waited, not when it was parked (show and --json
    # give the time): the table stays narrow enough for the tool's name.
    headers = ["TASK ID", "TOOL", "QUEUE", "STATE", "WAITED", "ARGUMENTS"]
    rows = [[approval.task_id, approval.name or "-", approval.queue, _state(approval, wanted),
             _age(approval.requested_at, now), _arguments(approval.arguments)]
            for approval in found]
    optional = ["ARGUMENTS", "QUEUE", "WAITED"]
    if any(approval.decided_at is not None for approval in found):
        headers[5:5] = ["DECIDED", "BY"]
        for approval, row in zip(found, rows, strict=True):
            row[5:5] = ([f"{_age(approval.decided_at, now)} ago", approval.decided_by or "-"]
                        if approval.decided_at is not None else ["-", "-"])
        optional = ["ARGUMENTS", "QUEUE", "WAITED", "BY", "DECIDED"]
    click.echo(render(headers, rows, shrink=["ARGUMENTS", "QUEUE", "BY"], optional=optional,
                      wide=wide, hint=True))
    shown = f"{len(found)} shown"
    if page.next_offset is not None:
        shown += f"; next page: --offset {page.next_offset}"
    click.echo(shown)


@approvals.command("show", needs=NEEDS_STORE)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON: the record, and what approvers see of its arguments "
                   "(\"shown\"; see docs/operations.md#what-approvers-see).")
@click.pass_context
def approvals_show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show one call's approval record in full, pending or decided."""
    approval = _approvals(ctx).get(task_id)
    if approval is None:
        fail(f"{task_id}: no such approval (the call never waited for one, "
              "or its record expired)")
    operations = _approvals(ctx)
    shown = operations.arguments(approval)
    if as_json:
        echo_json({**approval.to_dict(), "shown": shown.to_dict()})
        return
    width = terminal_width()
    decided = approval.decided_at is not None
    pairs = [
        ("task id", approval.task_id),
        ("tool", approval.name or "-"),
        ("queue", approval.queue),
        ("effect", approval.effect),
        ("state", approval.state.value),
        ("requested", f"{when(approval.requested_at)} "
                      f"({_age(approval.requested_at, time.time())} ago)"),
        ("run id", approval.run_id),
        ("worker", approval.worker or "-"),
        ("decided by", approval.decided_by or "-"),
        ("decided", when(approval.decided_at) if decided else "-"),
        ("reason", approval.reason or "-"),
        ("message kept", "yes" if approval.message is not None else "no"),
    ]
    click.echo(key_values(pairs, width=width))
    if shown.problem:
        click.echo(f"\narguments: not shown: {shown.problem}")
        return
    if shown.invisible:
        click.echo("\n" + textwrap.fill("warning: " + warning(shown.invisible), width=width))
    if shown.view is not None:
        click.echo("\narguments (as the tool shows them to approvers):")
        text = visible_json(shown.view)
    else:
        click.echo("\narguments:")
        text = visible_json({"args": shown.args, "kwargs": shown.kwargs})
    click.echo(textwrap.fill(text, width=width, initial_indent="  ", subsequent_indent="  ",
                             break_long_words=True))


def _decision_options(command: Any) -> Any:
    for option in reversed(
        [
            click.option("--by", metavar="NAME",
                         help="Who decides, for the audit (default: $TOOLEFFECT_ACTOR, "
                              "else user@host)."),
            click.option("--json", "as_json", is_flag=True,
                         help='Print JSON: {"results": [...], "done", "refused", "not_found", '
                              '"failed"}, as dlq replay --json (stable, see '
                              "docs/operations.md#from-the-command-line)."),
        ]
    ):
        command = option(command)
    return command


def _decide(ctx: click.Context, task_ids: tuple[str, ...], approve: bool, by: str | None,
            why: str, as_json: bool) -> None:
    if not task_ids:
        raise click.UsageError("give at least one task id")
    operations = _approvals(ctx)
    actor = (by or "").strip() or default_actor()
    reason = why.strip()[:REASON_LIMIT]
    decide = operations.approve if approve else operations.reject
    results = (decide(task_id, by=actor, reason=reason, via="cli") for task_id in task_ids)
    report(results, as_json, "approved" if approve else "rejected")


@approvals.command("approve", needs=NEEDS_STORE)
@click.argument("task_ids", nargs=-1)
@click.option("--reason", "why", default="", help="Why: written in the audit event.")
@_decision_options
@click.pass_context
def approvals_approve(ctx: click.Context, task_ids: tuple[str, ...], why: str,
                      by: str | None, as_json: bool) -> None:
    """Approve pending calls: each is published again and runs once (audited)."""
    _decide(ctx, task_ids, True, by, why, as_json)


@approvals.command("reject", needs=NEEDS_STORE)
@click.argument("task_ids", nargs=-1)
@click.option("--reason", "why", required=True,
              help="Why (required): written in the audit event and the call's error.")
@_decision_options
@click.pass_context
def approvals_reject(ctx: click.Context, task_ids: tuple[str, ...], why: str,
                     by: str | None, as_json: bool) -> None:
    """Reject pending calls: each ends FAILURE (ApprovalRejected), nothing of it runs."""
    if not why.strip():
        raise click.UsageError("a rejection needs a --reason: it is audited with why")
    _decide(ctx, task_ids, False, by, why, as_json)


@approvals.command("stats", needs=NEEDS_STORE)
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"pending", "by_queue", "by_tool", "by_queue_and_tool"} '
                   "(stable, see docs/operations.md#from-the-command-line).")
@wide_option
@click.pass_context
def approvals_stats(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """Count the calls waiting for approval, by queue and by tool."""
    stats = _approvals(ctx).stats()
    if as_json:
        echo_json(stats)
        return
    rows: list[list[str]] = [["pending", "", str(stats["pending"])]]
    for title, counts in (("queue", stats["by_queue"]), ("tool", stats["by_tool"])):
        for value, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            rows.append([title, value, str(count)])
    # A value (a queue, a tool's name) is never cut.
    click.echo(render(["BY", "VALUE", "PENDING"], rows, whole=["VALUE"], wide=wide))

