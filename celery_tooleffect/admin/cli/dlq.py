"""``dlq``: the dead letters: list, show, replay, purge, reconcile, stats.

Filters (``list``, and ``replay``/``purge``/``reconcile`` with ``--all``):
``--queue``, ``--dead-letter-reason``, ``--failure-class``, ``--effect``
(their choices: :mod:`celery_tooleffect.admin.filters`). ``--reason`` is only
ever the operator's why, written in the audit event of a replay or purge.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import click

from ...store.dead_letter_queries import Cursor
from ..filters import DEAD_LETTER_REASONS, EFFECTS, FAILURE_CLASSES, dead_letter_query
from ..operations import ActionResult, default_actor
from ..table import WHOLE, key_values, render, terminal_width
from ..visible import escape, visible_json
from .base import (
    NEEDS_BOTH,
    NEEDS_DEAD_LETTERS,
    Duration,
    ToolEffectGroup,
    echo_json,
    fail,
    operations_of,
    report,
    when,
    wide_option,
)

#: Where the ``--json`` forms are documented.
JSON_DOCS = "stable, see docs/operations.md#json-output"



@click.group(cls=ToolEffectGroup)
def dlq() -> None:
    """Dead letters: list, show, replay, purge, reconcile, stats."""


def _filters(command: Any) -> Any:
    """The filters of ``list``, and of ``replay``, ``purge`` and ``reconcile`` with ``--all``."""
    for option in reversed(
        [
            click.option("--queue", "-Q", metavar="QUEUE", help="Only this queue."),
            click.option("--dead-letter-reason", type=click.Choice(DEAD_LETTER_REASONS),
                         help="Only this dead-letter reason."),
            click.option("--failure-class", "-c", type=click.Choice(FAILURE_CLASSES),
                         help="Only this failure class."),
            click.option("--effect", "-e", type=click.Choice(EFFECTS),
                         help="Only this effect."),
        ]
    ):
        command = option(command)
    return command


def _refuse_reason_filter(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """``dlq list --reason``: the filter is ``--dead-letter-reason`` (renamed)."""
    if value is not None:
        raise click.UsageError(
            "--reason is the why of a replay or purge; filter by --dead-letter-reason", ctx
        )


@dlq.command("list", needs=NEEDS_DEAD_LETTERS)
@_filters
@click.option("--reason", hidden=True, expose_value=False, callback=_refuse_reason_filter)
@click.option("--limit", "-n", type=click.IntRange(1, 1000), default=50, show_default=True,
              help="How many to show.")
@click.option("--cursor", metavar="CURSOR",
              help="Start after this cursor (the next_cursor of an earlier page).")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"dead_letters": [...], "next_cursor", "total"} '
                   f"({JSON_DOCS}).")
@wide_option
@click.pass_context
def dlq_list(ctx: click.Context, queue: str | None, dead_letter_reason: str | None,
             failure_class: str | None, effect: str | None, limit: int, cursor: str | None,
             as_json: bool, wide: bool) -> None:
    """List dead letters, newest first, one page at a time (no full scan).

    The table keeps the task id, the dead-letter reason, the failure class and
    the exception at any width (the exception cut first); the tool, whole, and
    the other columns are left out, least important first, when they do not
    fit (--wide prints them all).
    """
    try:
        before = Cursor.decode(cursor) if cursor else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cursor") from None
    found = operations_of(ctx).listing(
        dead_letter_query(queue, dead_letter_reason, failure_class, effect), limit=limit,
        before=before,
    )
    if as_json:
        echo_json(found)
        return
    letters = found["dead_letters"]
    if not letters:
        click.echo("No dead letters match.")
        return
    click.echo(letter_table(letters, wide=wide))
    shown = f"{len(letters)} shown"
    if found["total"] is not None:
        shown += f" of {found['total']}"
    next_cursor = found["next_cursor"]
    click.echo(shown + (f"; next page: --cursor {next_cursor}" if next_cursor else ""))


#: ``dlq list``'s columns.
LETTER_HEADERS = ["TASK ID", "STORED (UTC)", "QUEUE", "TOOL", "EFFECT", "REASON", "CLASS",
                  "TRY", "EXCEPTION"]
#: The columns that may be left out, least important first: the task id, the
#: dead-letter reason, the failure class and the exception (what an operator
#: reads first) are always there; the tool next, whole, when it fits.
LETTER_OPTIONAL = ["TRY", "QUEUE", "STORED (UTC)", "EFFECT", "TOOL"]


def letter_table(letters: Sequence[Mapping[str, Any]], *, width: int | None = None,
                 wide: bool = False) -> str:
    """``dlq list``'s table of the listing's letters, fitting ``width`` (see
    :data:`LETTER_OPTIONAL`; the exception is cut, the reason and the class never)."""
    return render(
        LETTER_HEADERS,
        [[letter["task_id"], when(letter["dead_lettered_at"]), letter["queue"],
          letter["name"] or "-", letter["effect"], letter["reason"], letter["failure_class"],
          str(letter["attempts"]), _exception(letter)]
         for letter in letters],
        width=width, shrink=["EXCEPTION", "QUEUE"], optional=LETTER_OPTIONAL,
        # The reason and the class are the filters' words: never cut either.
        whole=(*WHOLE, "REASON", "CLASS"), wide=wide, hint=True,
    )


def _exception(letter: Mapping[str, Any]) -> str:
    """A listed letter's exception, marked when its write ran or an outcome came late."""
    marks = []
    if letter["body_completed"]:
        marks.append("body completed")
    if letter["late_outcomes"]:
        marks.append("late outcome")
    text = letter["exception_type"] or "-"
    return f"{text} ({', '.join(marks)})" if marks else text


@dlq.command("show", needs=NEEDS_DEAD_LETTERS)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"dead_letter", "journal", "replay_in_progress", "replay", '
                   f'"reconcile"}} ({JSON_DOCS}).')
@click.pass_context
def dlq_show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show one dead letter in full: envelope, journal, and whether it may be replayed."""
    detail = operations_of(ctx).detail(task_id)
    if detail is None:
        fail(f"{task_id}: no such dead letter")
    if as_json:
        echo_json(detail)
        return
    letter = detail["dead_letter"]
    replay = detail["replay"]
    width = terminal_width()
    if replay["allowed"]:
        verdict = "yes" + ("" if replay["bulk"] else " (by task id only)")
    elif replay["needs_force"]:
        verdict = "only with --force and a --reason"
    else:
        verdict = "no"
    pairs = [
        ("task id", letter["task_id"]),
        ("tool", letter["name"] or "-"),
        ("queue", letter["queue"]),
        ("effect", letter["effect"]),
        ("reason", letter["reason"]),
        ("failure class", letter["failure_class"]),
        ("exception", letter["exception_type"] or "-"),
        ("attempts", str(letter["attempts"])),
        ("body completed", "yes: the write already ran" if letter["body_completed"] else "no"),
        ("late outcomes", str(len(letter["late_outcomes"]))),
        ("run id", letter["run_id"]),
        ("worker", letter["worker"] or "-"),
        ("stored", when(letter["dead_lettered_at"])),
        ("journal", _journal_line(detail["journal"])),
        ("replayable", verdict),
    ]
    if detail["replay_in_progress"]:
        pairs.append(("note", "a replay or purge of it began and did not finish"))
    click.echo(key_values(pairs, width=width))
    if replay["refusal"]:
        click.echo("\n" + textwrap.fill(replay["refusal"], width=width))
    message = letter.get("message") or {}
    for title, value in (("error", letter["error"]), ("args", letter["args"]),
                         ("kwargs", letter["kwargs"]), ("canvas", letter.get("canvas")),
                         ("not decoded", letter.get("decode_error")),
                         ("headers", message.get("headers")),
                         ("properties", message.get("properties")),
                         ("body (base64)", message.get("body_base64"))):
        if value in (None, "", [], {}):
            continue
        # Nothing invisible: a hidden character is shown escaped (\u202e).
        text = escape(value) if isinstance(value, str) else visible_json(value,
                                                                          sort_keys=False)
        click.echo(f"\n{title}:")
        click.echo(textwrap.fill(text, width=width, initial_indent="  ",
                                 subsequent_indent="  ", break_long_words=True))


def _journal_line(journal: Mapping[str, str] | None) -> str:
    if not journal:
        return "-"
    parts = [journal.get("state", "?")]
    for name in ("attempt", "replays"):
        if journal.get(name):
            parts.append(f"{name}={journal[name]}")
    return " ".join(parts)


@dlq.command("replay", needs=NEEDS_BOTH)
@click.argument("task_ids", nargs=-1)
@click.option("--all", "replay_all", is_flag=True,
              help="Every dead letter matching the filters (READ_ONLY and IDEMPOTENT_WRITE "
                   "only; non-idempotent writes are refused).")
@_filters
@click.option("--force", is_flag=True,
              help="Replay one NON_IDEMPOTENT_WRITE, or a write whose body completed "
                   "(needs --reason).")
@click.option("--reason", "why", default="", help="Why: written in the audit event.")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"results": [...], "done", "refused", "not_found", "failed"} '
                   f"({JSON_DOCS}).")
@click.pass_context
def dlq_replay(ctx: click.Context, task_ids: tuple[str, ...], replay_all: bool,
               queue: str | None, dead_letter_reason: str | None, failure_class: str | None,
               effect: str | None, force: bool, why: str, as_json: bool) -> None:
    """Replay dead letters: reset the journal and publish each task again (same task id)."""
    _check_targets(task_ids, replay_all, queue, dead_letter_reason, failure_class, effect)
    if force and (replay_all or len(task_ids) > 1):
        raise click.UsageError("--force replays one task id at a time")
    if force and not why.strip():
        raise click.UsageError("--force needs --reason: a forced replay is audited with why")
    operations = operations_of(ctx)
    actor = default_actor()
    if replay_all:
        results: Iterable[ActionResult] = operations.replay_matching(
            dead_letter_query(queue, dead_letter_reason, failure_class, effect), actor=actor,
            reason=why,
        )
    else:
        results = (operations.replay(task_id, actor=actor, reason=why, force=force)
                   for task_id in task_ids)
    report(results, as_json, "replayed")


@dlq.command("purge", needs=NEEDS_BOTH)
@click.argument("task_ids", nargs=-1)
@click.option("--all", "purge_all", is_flag=True,
              help="Every dead letter matching the filters and --older-than.")
@click.option("--older-than", type=Duration(), metavar="DURATION",
              help="Every dead letter matching the filters stored longer ago than this "
                   "(90s, 15m, 2h, 7d, 1w; 0s: every age).")
@_filters
@click.option("--reason", "why", default="", help="Why: written in the audit event.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"results": [...], "done", "refused", "not_found", "failed"} '
                   f"({JSON_DOCS}).")
@click.pass_context
def dlq_purge(ctx: click.Context, task_ids: tuple[str, ...], purge_all: bool,
              older_than: float | None, queue: str | None, dead_letter_reason: str | None,
              failure_class: str | None, effect: str | None, why: str, yes: bool,
              as_json: bool) -> None:
    """Delete dead letters for good (audited). Asks first unless --yes.

    ``--older-than DURATION`` without task ids is ``--all --older-than DURATION``."""
    if purge_all and task_ids:
        raise click.UsageError("give task ids or --all, not both")
    if not task_ids and older_than is not None:
        purge_all = True  # the age selects, as --all --older-than does
    if not purge_all and not task_ids:
        raise click.UsageError("give at least one task id, or --older-than DURATION")
    if purge_all and older_than is None:
        raise click.UsageError("--all needs --older-than DURATION (use 0s for every age)")
    if not purge_all and (older_than is not None or queue or failure_class or effect
                          or dead_letter_reason):
        raise click.UsageError("--older-than and filters go with --all")
    operations = operations_of(ctx)
    actor = default_actor()
    if purge_all:
        assert older_than is not None
        query = dead_letter_query(queue, dead_letter_reason, failure_class, effect)
        count = operations.count_matching(query, older_than=older_than)
        if count == 0:
            if as_json:
                report([], True, "purged")
            else:
                click.echo("No dead letters match.")
            return
        _confirm(f"Purge {count} dead letter(s) for good?", yes)
        results: Iterable[ActionResult] = operations.purge_matching(
            query, older_than=older_than, actor=actor, reason=why
        )
    else:
        _confirm(f"Purge {len(task_ids)} dead letter(s) for good?", yes)
        results = (operations.purge(task_id, actor=actor, reason=why) for task_id in task_ids)
    report(results, as_json, "purged")


@dlq.command("reconcile", needs=NEEDS_BOTH)
@click.argument("task_ids", nargs=-1)
@click.option("--all", "reconcile_all", is_flag=True,
              help="Every dead letter matching the filters (those that cannot be "
                   "reconciled are refused).")
@_filters
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"results": [...], "done", "refused", "not_found", "failed"} '
                   f"({JSON_DOCS}).")
@click.pass_context
def dlq_reconcile(ctx: click.Context, task_ids: tuple[str, ...], reconcile_all: bool,
                  queue: str | None, dead_letter_reason: str | None,
                  failure_class: str | None, effect: str | None, as_json: bool) -> None:
    """Ask each dead letter's tool whether its write happened (its reconcile), and
    end it so: applied settles SUCCESS, not applied replays it (a revoked one
    stays), unknown leaves it. Audited, with the evidence."""
    _check_targets(task_ids, reconcile_all, queue, dead_letter_reason, failure_class, effect)
    operations = operations_of(ctx)
    actor = default_actor()
    if reconcile_all:
        results: Iterable[ActionResult] = operations.reconcile_matching(
            dead_letter_query(queue, dead_letter_reason, failure_class, effect), actor=actor
        )
    else:
        results = (operations.reconcile(task_id, actor=actor) for task_id in task_ids)
    report(results, as_json, "reconciled")


def _check_targets(task_ids: tuple[str, ...], every: bool, *filters: str | None) -> None:
    """Task ids or ``--all`` (with the filters), never both, never neither."""
    if every and task_ids:
        raise click.UsageError("give task ids or --all, not both")
    if not every and not task_ids:
        raise click.UsageError("give at least one task id, or --all")
    if not every and any(filters):
        raise click.UsageError("filters go with --all")


def _confirm(question: str, yes: bool) -> None:
    if yes:
        return
    if not sys.stdin or not sys.stdin.isatty():
        fail(f"{question} Not confirmed (no terminal): pass --yes.")
    if not click.confirm(question, default=False):
        fail("Not confirmed: nothing purged.")


@dlq.command("stats", needs=NEEDS_DEAD_LETTERS)
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"total", "by_queue", "by_reason", "by_failure_class", '
                   f'"by_effect", "replay_pending", "by_combination"}} ({JSON_DOCS}).')
@wide_option
@click.pass_context
def dlq_stats(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """Count dead letters by queue, reason, failure class and effect (from index sizes),
    and of each combination of the four (``queue/reason/failure class/effect``)."""
    stats = operations_of(ctx).stats()
    if as_json:
        echo_json(stats.to_dict())
        return
    rows: list[list[str]] = [["total", "", str(stats.total)]]
    for title, counts in (("queue", stats.by_queue), ("reason", stats.by_reason),
                          ("failure class", stats.by_failure_class),
                          ("effect", stats.by_effect)):
        for value, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            rows.append([title, value, str(count)])
    for row in stats.by_combination:
        rows.append(["combination",
                     "/".join((row.queue, row.reason, row.failure_class, row.effect)),
                     str(row.count)])
    if stats.replay_pending:
        rows.append(["replay pending", "", str(stats.replay_pending)])
    # A value (a queue, a combination) is never cut.
    click.echo(render(["BY", "VALUE", "COUNT"], rows, whole=["VALUE"], wide=wide))

