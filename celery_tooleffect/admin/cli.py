"""The operator's command line: ``celery -A app tooleffect ...``, ``celery-tooleffect -A app ...``.

The same click group is installed twice: as a Celery sub-command (entry point
group ``celery.commands``, name ``tooleffect``), which gets the app from
Celery's own ``-A``, and as the console script ``celery-tooleffect``, which
takes ``-A/--app`` itself. Commands::

    dlq list [--queue Q] [--dead-letter-reason R] [--failure-class C] [--effect E]
             [--limit N] [--cursor C] [--json]
    dlq show TASK_ID [--json]
    dlq replay TASK_ID... | --all [filters]   [--force] [--reason TEXT] [--json]
    dlq purge TASK_ID... | --all --older-than DURATION [filters]  [--yes] [--reason TEXT]
    dlq stats [--json]
    approvals list [--queue Q] [--tool NAME] [--state S] [--limit N] [--offset N] [--json]
    approvals show TASK_ID [--json]
    approvals approve TASK_ID... [--reason TEXT] [--by NAME] [--json]
    approvals reject TASK_ID... --reason TEXT [--by NAME] [--json]
    approvals stats [--json]
    audit show RUN_ID [--json]
    audit tail [--count N] [--follow] [--json]
    tools [--json]
    flower [flower options]

Filters (``list``, and ``replay``/``purge`` with ``--all``): ``--queue``,
``--dead-letter-reason``, ``--failure-class``, ``--effect``. ``--reason`` is
only ever the operator's why, written in the audit event of a replay or purge.

Exit codes: 0 done; 1 refused, not found, or the store could not be reached
(``audit verify``: a chain broken; ``tools``: live workers disagree about a
tool's effect); 2 usage error (click's own). A store that is down or refuses, a broker that is
down, or invalid settings end any command with one line on stderr (which
store, its URL without password, and the error) and exit code 1, never a
traceback: every command is a :class:`StoreCommand`.

Human output is an aligned table no wider than the terminal; ``--json``
output is stable and documented in the README. Who acts is
``$TOOLEFFECT_ACTOR``, else ``user@host``; it is written in the audit event of
every replay and purge, and of every approval decision (``--by`` names
someone else).

This module is imported by every ``celery`` command (through the entry
point), so it imports the rest of the package only when a command runs.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    from celery import Celery

    from ..admin.approvals import Approvals
    from ..admin.operations import ActionResult, DeadLetterOperations
    from ..store.dead_letters import DeadLetter, DeadLetterQuery
    from ..store.runtime import ToolRuntime

EXIT_REFUSED = 1

_REASONS = (
    "not_retryable", "retries_exhausted", "interrupted_write", "unknown_task",
    "undecodable_message", "malformed_message", "revoked", "call_id_conflict",
)
_CLASSES = (
    "connection", "rate_limit", "auth", "configuration", "client_error", "server_error",
    "circuit_open", "unknown",
)
_EFFECTS = ("read_only", "idempotent_write", "non_idempotent_write")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d`` or ``1w`` as seconds."""
    match = _DURATION.match(value)
    if not match:
        raise ValueError(f"not a duration: {value!r} (use e.g. 90s, 15m, 2h, 7d, 1w)")
    return float(match.group(1)) * _UNITS[match.group(2)]


class Duration(click.ParamType):  # type: ignore[type-arg]
    """A click parameter: a duration such as ``15m`` or ``7d``, in seconds."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# -- context -------------------------------------------------------------------------


def _app(ctx: click.Context) -> Celery:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: pass -A/--app")
    return app


def _runtime(ctx: click.Context) -> ToolRuntime:
    """The app's runtime, once each store the command needs answers a PING (else
    one line that names the store, and exit code 1)."""
    from ..admin.operations import store_problem
    from ..store.runtime import runtime_for

    runtime = runtime_for(_app(ctx))
    problem = store_problem(runtime, getattr(ctx.command, "needs", ()))
    if problem:
        _fail(problem)
    return runtime


def _operations(ctx: click.Context) -> DeadLetterOperations:
    from ..admin.operations import DeadLetterOperations

    return DeadLetterOperations(_app(ctx), _runtime(ctx))


def _fail(message: str) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(EXIT_REFUSED)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False, default=str))


def _when(timestamp: float | str | None) -> str:
    try:
        moment = datetime.fromtimestamp(float(timestamp or 0), tz=timezone.utc)
    except (TypeError, ValueError):
        return str(timestamp or "")
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


# -- the commands --------------------------------------------------------------------

#: The stores a command needs (``needs``): the names of
#: :data:`celery_tooleffect.admin.operations.STORE` and ``DEAD_LETTER_STORE``,
#: spelled out since this module imports the package only when a command runs.
STORE = ("store",)
DEAD_LETTERS = ("dead-letter store",)
BOTH = STORE + DEAD_LETTERS


class StoreCommand(click.Command):
    """A command that ends with one line on stderr and exit code 1, never a
    traceback, when a store it needs is down or refuses, the broker is down, or
    the app's settings are invalid (the line says which, see
    :func:`~celery_tooleffect.admin.operations.explain`).

    ``needs``: the stores it uses (:data:`STORE`, :data:`DEAD_LETTERS`). Each is
    PINGed when the command first reaches for the store (after its usage checks),
    so a store that is away is named before anything is done, not once per task.
    """

    def __init__(self, *args: Any, needs: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.needs = needs

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            from ..admin.operations import explain

            problem = explain(_app(ctx), exc, self.needs or BOTH)
            if problem is None:
                raise
            _fail(problem)


class _Group(click.Group):
    """A group whose commands are :class:`StoreCommand` (and sub-groups, such groups)."""

    command_class = StoreCommand
    group_class = type


# -- the group ---------------------------------------------------------------------


@click.group(name="tooleffect", cls=_Group)
def tooleffect() -> None:
    """celery-tooleffect: dead letters, approvals, audit trails, Flower with a Dead letters page."""


@tooleffect.group()
def dlq() -> None:
    """Dead letters: list, show, replay, purge, stats."""


def _filters(command: Any) -> Any:
    for option in reversed(
        [
            click.option("--queue", "-Q", metavar="QUEUE", help="Only this queue."),
            click.option("--dead-letter-reason", type=click.Choice(_REASONS),
                         help="Only this dead-letter reason."),
            click.option("--failure-class", "-c", type=click.Choice(_CLASSES),
                         help="Only this failure class."),
            click.option("--effect", "-e", type=click.Choice(_EFFECTS),
                         help="Only this effect."),
        ]
    ):
        command = option(command)
    return command


def _query(queue: str | None, dead_letter_reason: str | None, failure_class: str | None,
           effect: str | None) -> DeadLetterQuery:
    from ..store.dead_letters import DeadLetterQuery

    return DeadLetterQuery(queue=queue or None, reason=dead_letter_reason or None,
                           failure_class=failure_class or None, effect=effect or None)


def _refuse_reason_filter(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """``dlq list --reason``: the filter is ``--dead-letter-reason`` (renamed)."""
    if value is not None:
        raise click.UsageError(
            "--reason is the why of a replay or purge; filter by --dead-letter-reason", ctx
        )


@dlq.command("list", needs=DEAD_LETTERS)
@_filters
@click.option("--reason", hidden=True, expose_value=False, callback=_refuse_reason_filter)
@click.option("--limit", "-n", type=click.IntRange(1, 1000), default=50, show_default=True,
              help="How many to show.")
@click.option("--cursor", metavar="CURSOR",
              help="Start after this cursor (the next_cursor of an earlier page).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the README).")
@click.pass_context
def dlq_list(ctx: click.Context, queue: str | None, dead_letter_reason: str | None,
             failure_class: str | None, effect: str | None, limit: int, cursor: str | None,
             as_json: bool) -> None:
    """List dead letters, newest first, one page at a time (no full scan)."""
    from ..admin.operations import letter_summary
    from ..store.dead_letters import Cursor

    try:
        before = Cursor.decode(cursor) if cursor else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cursor") from None
    operations = _operations(ctx)
    page = operations.runtime.dead_letters.page(
        _query(queue, dead_letter_reason, failure_class, effect), limit=limit, before=before,
    )
    privacy = operations.privacy
    next_cursor = page.next_cursor.encode() if page.next_cursor else None
    if as_json:
        _echo_json({
            "dead_letters": [letter_summary(letter, privacy, operations.accept)
                             for letter in page.letters],
            "next_cursor": next_cursor,
            "total": page.total,
        })
        return
    if not page.letters:
        click.echo("No dead letters match.")
        return
    from ..admin.table import render

    click.echo(render(
        ["TASK ID", "STORED (UTC)", "QUEUE", "TOOL", "EFFECT", "REASON", "CLASS", "TRY",
         "EXCEPTION"],
        [[letter.task_id, _when(letter.dead_lettered_at), letter.queue,
          letter.name or "-", letter.effect, letter.reason, letter.failure_class,
          str(letter.attempts), _exception(letter)]
         for letter in page.letters],
        shrink=["EXCEPTION", "TOOL", "QUEUE", "REASON", "EFFECT", "CLASS"],
        optional=["EXCEPTION", "TRY", "CLASS", "QUEUE", "STORED (UTC)", "REASON"],
    ))
    shown = f"{len(page.letters)} shown"
    if page.total is not None:
        shown += f" of {page.total}"
    click.echo(shown + (f"; next page: --cursor {next_cursor}" if next_cursor else ""))


def _exception(letter: DeadLetter) -> str:
    marks = []
    if letter.body_completed:
        marks.append("body completed")
    if letter.late_outcomes:
        marks.append("late outcome")
    text = letter.exception_type or "-"
    return f"{text} ({', '.join(marks)})" if marks else text


@dlq.command("show", needs=DEAD_LETTERS)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the README).")
@click.pass_context
def dlq_show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show one dead letter in full: envelope, journal, and whether it may be replayed."""
    detail = _operations(ctx).detail(task_id)
    if detail is None:
        _fail(f"{task_id}: no such dead letter")
    if as_json:
        _echo_json(detail)
        return
    from ..admin.table import key_values, terminal_width

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
        ("stored", _when(letter["dead_lettered_at"])),
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
                         ("body (base64)", message.get("body_base64")),
                         ("options (version 1 letter)", letter.get("options")),
                         ("raw body (version 1 letter)", letter.get("raw_body"))):
        if value in (None, "", [], {}):
            continue
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                               default=str)
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


@dlq.command("replay", needs=BOTH)
@click.argument("task_ids", nargs=-1)
@click.option("--all", "replay_all", is_flag=True,
              help="Every dead letter matching the filters (READ_ONLY and IDEMPOTENT_WRITE "
                   "only; non-idempotent writes are refused).")
@_filters
@click.option("--force", is_flag=True,
              help="Replay one NON_IDEMPOTENT_WRITE, or a write whose body completed "
                   "(needs --reason).")
@click.option("--reason", "why", default="", help="Why: written in the audit event.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the README).")
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
    from ..admin.operations import default_actor

    operations = _operations(ctx)
    actor = default_actor()
    if replay_all:
        results: Iterable[ActionResult] = operations.replay_matching(
            _query(queue, dead_letter_reason, failure_class, effect), actor=actor, reason=why
        )
    else:
        results = (operations.replay(task_id, actor=actor, reason=why, force=force)
                   for task_id in task_ids)
    _report(results, as_json, "replayed")


@dlq.command("purge", needs=BOTH)
@click.argument("task_ids", nargs=-1)
@click.option("--all", "purge_all", is_flag=True,
              help="Every dead letter matching the filters and --older-than.")
@click.option("--older-than", type=Duration(), metavar="DURATION",
              help="With --all: stored longer ago than this (90s, 15m, 2h, 7d, 1w).")
@_filters
@click.option("--reason", "why", default="", help="Why: written in the audit event.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the README).")
@click.pass_context
def dlq_purge(ctx: click.Context, task_ids: tuple[str, ...], purge_all: bool,
              older_than: float | None, queue: str | None, dead_letter_reason: str | None,
              failure_class: str | None, effect: str | None, why: str, yes: bool,
              as_json: bool) -> None:
    """Delete dead letters for good (audited). Asks first unless --yes."""
    if purge_all and task_ids:
        raise click.UsageError("give task ids or --all, not both")
    if not purge_all and not task_ids:
        raise click.UsageError("give at least one task id, or --all --older-than DURATION")
    if purge_all and older_than is None:
        raise click.UsageError("--all needs --older-than DURATION (use 0s for every age)")
    if not purge_all and (older_than is not None or queue or failure_class or effect
                          or dead_letter_reason):
        raise click.UsageError("--older-than and filters go with --all")
    from ..admin.operations import default_actor

    operations = _operations(ctx)
    actor = default_actor()
    if purge_all:
        assert older_than is not None
        query = _query(queue, dead_letter_reason, failure_class, effect)
        count = operations.count_matching(query, older_than=older_than)
        if count == 0:
            if as_json:
                _report([], True, "purged")
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
    _report(results, as_json, "purged")


@dlq.command("reconcile", needs=BOTH)
@click.argument("task_ids", nargs=-1)
@click.option("--all", "reconcile_all", is_flag=True,
              help="Every dead letter matching the filters (those that cannot be "
                   "reconciled are refused).")
@_filters
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the documentation).")
@click.pass_context
def dlq_reconcile(ctx: click.Context, task_ids: tuple[str, ...], reconcile_all: bool,
                  queue: str | None, dead_letter_reason: str | None,
                  failure_class: str | None, effect: str | None, as_json: bool) -> None:
    """Ask each dead letter's tool whether its write happened (its reconcile), and
    end it so: applied settles SUCCESS, not applied replays it (a revoked one
    stays), unknown leaves it. Audited, with the evidence."""
    _check_targets(task_ids, reconcile_all, queue, dead_letter_reason, failure_class, effect)
    from ..admin.operations import default_actor

    operations = _operations(ctx)
    actor = default_actor()
    if reconcile_all:
        results: Iterable[ActionResult] = operations.reconcile_matching(
            _query(queue, dead_letter_reason, failure_class, effect), actor=actor
        )
    else:
        results = (operations.reconcile(task_id, actor=actor) for task_id in task_ids)
    _report(results, as_json, "reconciled")


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
        _fail(f"{question} Not confirmed (no terminal): pass --yes.")
    if not click.confirm(question, default=False):
        _fail("Not confirmed: nothing purged.")


def _report(results: Iterable[ActionResult], as_json: bool, done_word: str) -> None:
    from ..admin.operations import Outcome, results_summary

    if as_json:
        listed = list(results)
        _echo_json(results_summary(listed))
        if any(not result.ok for result in listed):
            sys.exit(EXIT_REFUSED)
        return
    # Printed as they come and only counted: a bulk action over a million
    # letters must not hold a million results.
    counts = {outcome: 0 for outcome in Outcome}
    for result in results:
        counts[result.outcome] += 1
        label = "ok" if result.ok else result.outcome.value
        click.echo(f"{label}: {result.message}", err=result.outcome is not Outcome.DONE)
    click.echo(
        f"{counts[Outcome.DONE]} {done_word}, {counts[Outcome.REFUSED]} refused, "
        f"{counts[Outcome.NOT_FOUND]} not found, {counts[Outcome.FAILED]} failed"
    )
    if sum(counts.values()) != counts[Outcome.DONE]:
        sys.exit(EXIT_REFUSED)


@dlq.command("stats", needs=DEAD_LETTERS)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the README).")
@click.pass_context
def dlq_stats(ctx: click.Context, as_json: bool) -> None:
    """Count dead letters by queue, reason, failure class and effect (from index sizes),
    and of each combination of the four (``queue/reason/failure class/effect``)."""
    stats = _operations(ctx).stats()
    if as_json:
        _echo_json(stats.to_dict())
        return
    from ..admin.table import render

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
    click.echo(render(["BY", "VALUE", "COUNT"], rows, shrink=["VALUE"]))


# -- approvals -------------------------------------------------------------------------


#: The states ``approvals list --state`` picks (ApprovalState values a listed call has).
_APPROVAL_STATES = ("pending", "approved", "rejected", "expired")


@tooleffect.group()
def approvals() -> None:
    """Calls that wait for a person's approval: list, show, approve, reject, stats."""


def _approvals(ctx: click.Context) -> Approvals:
    from ..admin.approvals import Approvals

    _runtime(ctx)
    return Approvals(_app(ctx))


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


@approvals.command("list", needs=STORE)
@click.option("--queue", "-Q", metavar="QUEUE", help="Only this queue.")
@click.option("--tool", "-t", metavar="NAME", help="Only this tool (task name).")
@click.option("--state", "-s", type=click.Choice(_APPROVAL_STATES),
              help="Only this state (decided calls are listed until published again).")
@click.option("--limit", "-n", type=click.IntRange(1, 1000), default=50, show_default=True,
              help="How many to show.")
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True,
              help="Skip this many first (the next page: --offset plus --limit).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the documentation).")
@click.pass_context
def approvals_list(ctx: click.Context, queue: str | None, tool: str | None,
                   state: str | None, limit: int, offset: int, as_json: bool) -> None:
    """List calls waiting for approval (and decided ones not yet published), oldest first."""
    import time

    found = _approvals(ctx).list(queue=queue or None, tool=tool or None,
                                 state=state or None, limit=limit, offset=offset)
    if as_json:
        _echo_json({"approvals": [approval.to_dict() for approval in found],
                    "count": len(found)})
        return
    if not found:
        click.echo("No approvals match.")
        return
    from ..admin.table import render

    now = time.time()
    # How long each call has waited, not when it was parked (show and --json
    # give the time): the table stays narrow enough for the tool's name.
    click.echo(render(
        ["TASK ID", "TOOL", "QUEUE", "STATE", "WAITED", "ARGUMENTS"],
        [[approval.task_id, approval.name or "-", approval.queue, approval.state.value,
          _age(approval.requested_at, now), _arguments(approval.arguments)]
         for approval in found],
        shrink=["ARGUMENTS", "TOOL", "QUEUE"],
        optional=["ARGUMENTS", "QUEUE", "WAITED"],
    ))
    shown = f"{len(found)} shown"
    if len(found) == limit:
        shown += f"; next page: --offset {offset + limit}"
    click.echo(shown)


@approvals.command("show", needs=STORE)
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the documentation).")
@click.pass_context
def approvals_show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Show one call's approval record in full, pending or decided."""
    import time

    approval = _approvals(ctx).get(task_id)
    if approval is None:
        _fail(f"{task_id}: no such approval (the call never waited for one, "
              "or its record expired)")
    if as_json:
        _echo_json(approval.to_dict())
        return
    from ..admin.table import key_values, terminal_width

    width = terminal_width()
    decided = approval.decided_at is not None
    pairs = [
        ("task id", approval.task_id),
        ("tool", approval.name or "-"),
        ("queue", approval.queue),
        ("effect", approval.effect),
        ("state", approval.state.value),
        ("requested", f"{_when(approval.requested_at)} "
                      f"({_age(approval.requested_at, time.time())} ago)"),
        ("run id", approval.run_id),
        ("worker", approval.worker or "-"),
        ("decided by", approval.decided_by or "-"),
        ("decided", _when(approval.decided_at) if decided else "-"),
        ("reason", approval.reason or "-"),
        ("message kept", "yes" if approval.message is not None else "no"),
    ]
    click.echo(key_values(pairs, width=width))
    click.echo("\narguments:")
    text = json.dumps(dict(approval.arguments), ensure_ascii=False, sort_keys=True)
    click.echo(textwrap.fill(text, width=width, initial_indent="  ", subsequent_indent="  ",
                             break_long_words=True))


def _decision_options(command: Any) -> Any:
    for option in reversed(
        [
            click.option("--by", metavar="NAME",
                         help="Who decides, for the audit (default: $TOOLEFFECT_ACTOR, "
                              "else user@host)."),
            click.option("--json", "as_json", is_flag=True,
                         help="Print JSON (as dlq replay --json)."),
        ]
    ):
        command = option(command)
    return command


def _decide(ctx: click.Context, task_ids: tuple[str, ...], approve: bool, by: str | None,
            why: str, as_json: bool) -> None:
    if not task_ids:
        raise click.UsageError("give at least one task id")
    from ..admin.operations import REASON_LIMIT, default_actor

    operations = _approvals(ctx)
    actor = (by or "").strip() or default_actor()
    reason = why.strip()[:REASON_LIMIT]
    decide = operations.approve if approve else operations.reject
    results = (decide(task_id, by=actor, reason=reason, via="cli") for task_id in task_ids)
    _report(results, as_json, "approved" if approve else "rejected")


@approvals.command("approve", needs=STORE)
@click.argument("task_ids", nargs=-1)
@click.option("--reason", "why", default="", help="Why: written in the audit event.")
@_decision_options
@click.pass_context
def approvals_approve(ctx: click.Context, task_ids: tuple[str, ...], why: str,
                      by: str | None, as_json: bool) -> None:
    """Approve pending calls: each is published again and runs once (audited)."""
    _decide(ctx, task_ids, True, by, why, as_json)


@approvals.command("reject", needs=STORE)
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


@approvals.command("stats", needs=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the documentation).")
@click.pass_context
def approvals_stats(ctx: click.Context, as_json: bool) -> None:
    """Count the calls waiting for approval, by queue and by tool."""
    stats = _approvals(ctx).stats()
    if as_json:
        _echo_json(stats)
        return
    from ..admin.table import render

    rows: list[list[str]] = [["pending", "", str(stats["pending"])]]
    for title, counts in (("queue", stats["by_queue"]), ("tool", stats["by_tool"])):
        for value, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            rows.append([title, value, str(count)])
    click.echo(render(["BY", "VALUE", "PENDING"], rows, shrink=["VALUE"]))


# -- audit ----------------------------------------------------------------------------


@tooleffect.group()
def audit() -> None:
    """Audit trails: one run's events, or the newest events of all runs."""


_EVENT_HEADERS = ["SEQ", "TIME (UTC)", "TASK ID", "TOOL", "PHASE", "STATUS", "TRY", "CLASS",
                  "EXCEPTION", "BY"]


def _event_row(event: Mapping[str, str]) -> list[str]:
    return [
        event.get("seq", ""), _when(event.get("ts")), event.get("task_id", ""),
        event.get("tool", ""), event.get("phase", ""), event.get("status", ""),
        event.get("attempt", ""), event.get("failure_class", ""),
        event.get("exception_type", ""), event.get("actor") or event.get("worker", ""),
    ]


@audit.command("show", needs=STORE)
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the README).")
@click.pass_context
def audit_show(ctx: click.Context, run_id: str, as_json: bool) -> None:
    """Show the audit events of one run, oldest first."""
    events = _runtime(ctx).audit.events(run_id)
    if as_json:
        _echo_json({"run_id": run_id, "events": events})
        if not events:
            sys.exit(EXIT_REFUSED)
        return
    if not events:
        _fail(f"{run_id}: no audit events for this run")
    from ..admin.table import render

    click.echo(render(_EVENT_HEADERS, [_event_row(event) for event in events],
                      shrink=["TOOL", "BY", "EXCEPTION"],
                      optional=["BY", "EXCEPTION", "TIME (UTC)", "CLASS", "TRY", "TOOL"]))


@audit.command("verify", needs=STORE)
@click.argument("run_ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Verify every run in the store.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the README).")
@click.pass_context
def audit_verify(ctx: click.Context, run_ids: tuple[str, ...], every: bool,
                 as_json: bool) -> None:
    """Check the hash chain of runs' audit events; report the first broken link.

    Exit code 0 when every chain is intact, 1 when one is broken or a run has
    no events.
    """
    if bool(run_ids) == every:
        raise click.UsageError("give RUN_ID... or --all (not both)")
    log = _runtime(ctx).audit
    checks = [log.verify(run_id) for run_id in (log.runs() if every else run_ids)]
    bad = [check for check in checks if not check.intact or check.events == 0]
    if as_json:
        _echo_json({"runs": [
            {"run_id": c.run_id, "events": c.events, "intact": c.intact and c.events > 0,
             "broken_at": c.broken_at, "problem": c.problem or (None if c.events else
                                                                "no events")}
            for c in checks
        ]})
    else:
        for check in checks:
            if check.events == 0:
                click.echo(f"{check.run_id}: no events")
            elif check.intact:
                click.echo(f"{check.run_id}: intact ({check.events} events)")
            else:
                click.echo(f"{check.run_id}: BROKEN at {check.broken_at}: {check.problem}")
        click.echo(f"{len(checks) - len(bad)} of {len(checks)} run(s) intact")
    if bad:
        sys.exit(EXIT_REFUSED)


#: Widths of the tail's padded fields: time, phase, status. The ids follow in full
#: (an operator copies them), then the tool, class and who; lines are clipped
#: at the terminal's width.
_TAIL_WIDTHS = (8, 14, 13)


def _tail_line(event: Mapping[str, str], width: int) -> str:
    from ..admin.table import clip, cut

    ts = event.get("ts", "")
    moment = _when(ts)[11:19] if ts and ts[0].isdigit() else ts
    padded = (moment, event.get("phase", ""), event.get("status", ""))
    text = " ".join(cut(value, w).ljust(w) for value, w in zip(padded, _TAIL_WIDTHS,
                                                              strict=True))
    rest = [event.get("run_id", ""), event.get("task_id", ""), event.get("tool", ""),
            event.get("failure_class", ""), event.get("actor") or event.get("worker", "")]
    return clip(" ".join([text, *(value for value in rest if value)]).rstrip(), width)


@audit.command("tail", needs=STORE)
@click.option("--count", "-n", type=click.IntRange(1, 10_000), default=20, show_default=True,
              help="How many of the newest events to show first.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events (Ctrl-C stops).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def audit_tail(ctx: click.Context, count: int, follow: bool, as_json: bool) -> None:
    """Show the newest events of all runs (the global stream); --follow keeps going."""
    from ..admin.table import terminal_width
    from ..store.audit import text

    log = _runtime(ctx).audit
    width = terminal_width()

    def emit(event: Mapping[str, str]) -> None:
        if as_json:
            click.echo(json.dumps(dict(event), sort_keys=True, ensure_ascii=False))
        else:
            click.echo(_tail_line(event, width))

    try:
        events = log.tail(count)
        if not as_json:
            click.echo(_tail_line({"ts": "UTC", "run_id": "RUN ID", "task_id": "TASK ID",
                                   "tool": "TOOL", "phase": "PHASE", "status": "STATUS",
                                   "failure_class": "CLASS", "actor": "BY"}, width))
        for event in events:
            emit(event)
        if not follow:
            return
        last = events[-1]["id"] if events else "$"
        client = log.client
        key = log.keys.global_events
        while True:
            block = max(int(min(log.settings.socket_timeout * 500, 1000)), 100)
            replies: Any = client.xread({key: last}, block=block, count=100) or []
            for _stream, entries in replies:
                for entry_id, fields in entries:
                    last = text(entry_id)
                    emit({"id": last, **{text(k): text(v) for k, v in fields.items()}})
            sys.stdout.flush()
    except KeyboardInterrupt:
        return


# -- tools ---------------------------------------------------------------------------


@tooleffect.command("tools", needs=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (see the documentation).")
@click.pass_context
def tools_command(ctx: click.Context, as_json: bool) -> None:
    """List the tools live workers declare: each effect, and the workers (and
    releases) declaring it. Exit code 1 when live workers disagree about a
    tool's effect (a rolling upgrade that changes it: each call is then handled
    under the strictest effect its journal recorded)."""
    from ..store.declarations import EffectDeclarations, by_tool

    workers = EffectDeclarations(_runtime(ctx).settings).live()
    tools = by_tool(workers)
    conflicts = [tool for tool in tools if tool.conflict]
    if as_json:
        _echo_json({
            "tools": [{
                "name": tool.name,
                "effects": tool.effects,
                "strictest": tool.strictest,
                "conflict": tool.conflict,
                "declared_by": [{"worker": d.worker, "release": d.release, "effect": d.effect}
                                for d in tool.declarers],
            } for tool in tools],
            "workers": [{
                "worker": w.worker, "release": w.release, "pid": w.pid,
                "seen_at": w.seen_at, "expires_at": w.expires_at, "tools": dict(w.tools),
            } for w in workers],
            "conflicts": [tool.name for tool in conflicts],
        })
    elif not workers:
        click.echo("No live worker declares any tool (a worker publishes its tools' effects "
                   "when it starts, and again while it runs).")
    else:
        from ..admin.table import render, terminal_width

        rows = []
        for tool in tools:
            for effect in tool.effects:
                declarers = [d for d in tool.declarers if d.effect == effect]
                rows.append([tool.name, effect, _releases(declarers), str(len(declarers)),
                             ", ".join(d.worker for d in declarers),
                             "CONFLICT" if tool.conflict else ""])
        click.echo(render(["TOOL", "EFFECT", "RELEASE", "WORKERS", "DECLARED BY", "NOTE"], rows,
                          shrink=["DECLARED BY", "TOOL"], optional=["DECLARED BY"]))
        width = terminal_width()
        for tool in conflicts:
            said = "; ".join(
                f"{effect} by {len(declarers)} worker(s) of release {_releases(declarers)}"
                for effect in tool.effects
                for declarers in [[d for d in tool.declarers if d.effect == effect]])
            click.echo("\n" + textwrap.fill(
                f"CONFLICT {tool.name}: {said}. A call its journal recorded as "
                f"{tool.strictest} is handled as {tool.strictest} by every worker; finish "
                "the upgrade or roll it back.", width=width))
        click.echo(f"\n{len(tools)} tool(s), {len(workers)} live worker(s), "
                   f"{len(conflicts)} conflict(s)")
    if conflicts:
        sys.exit(EXIT_REFUSED)


def _releases(declarers: Iterable[Any]) -> str:
    """The distinct releases of ``declarers`` (``-`` for a worker that names none)."""
    return ", ".join(sorted({d.release or "-" for d in declarers}))


# -- flower --------------------------------------------------------------------------


@tooleffect.command(
    "flower", context_settings={"ignore_unknown_options": True, "allow_extra_args": True}
)
@click.argument("flower_argv", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def flower_command(ctx: click.Context, flower_argv: tuple[str, ...]) -> None:
    """Start Flower 2.x with a "Dead letters" page (takes Flower's own options)."""
    try:
        from ..admin.flower import run_flower
    except ImportError as exc:  # pragma: no cover - depends on the extra
        _fail(f"Flower is not installed ({exc}): pip install 'celery-tooleffect[flower]'")
    quiet = bool(getattr(ctx.find_root().obj, "quiet", False))
    run_flower(_app(ctx), list(flower_argv), quiet=quiet)


# -- the console script --------------------------------------------------------------


@click.group(name="celery-tooleffect", commands=tooleffect.commands)
@click.option("-A", "--app", "app_name", required=True, metavar="APP",
              help="The Celery app (module or module:attribute), as for celery -A.")
@click.option("--workdir", type=click.Path(file_okay=False, exists=True),
              help="Change to this folder first (where the app module is found).")
@click.pass_context
def main(ctx: click.Context, app_name: str, workdir: str | None) -> None:
    """celery-tooleffect: dead letters, approvals, audit trails, Flower with a Dead letters page."""
    import os

    from celery.app.utils import find_app
    from celery.bin.base import CLIContext

    if workdir:
        os.chdir(workdir)
    try:
        app = find_app(app_name)
    except Exception as exc:
        raise click.UsageError(f"cannot load the app {app_name!r}: {exc}") from exc
    ctx.obj = CLIContext(app=app, no_color=True, workdir=workdir, quiet=False)


if __name__ == "__main__":  # python -m celery_tooleffect.admin.cli -A app ...
    main()
