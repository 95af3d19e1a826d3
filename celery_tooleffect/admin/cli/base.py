"""What every command shares: the app and its stores, the commands' class (one
line and exit code 1 when a store is away), and how a command answers (JSON,
UTC times, one line on stderr, an action's results)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ...store.runtime import ToolRuntime, runtime_for
from ..filters import parse_duration
from ..operations import (
    BOTH_STORES,
    DEAD_LETTER_STORE,
    STORE,
    ActionResult,
    DeadLetterOperations,
    Outcome,
    explain,
    results_summary,
    store_problem,
)
from ..visible import visible_json

if TYPE_CHECKING:
    from celery import Celery

#: The exit code of a command refused, not found, or whose store could not be reached.
EXIT_REFUSED = 1

#: The stores a command needs (``needs``): each is PINGed first (:class:`StoreCommand`).
NEEDS_STORE = (STORE,)
NEEDS_DEAD_LETTERS = (DEAD_LETTER_STORE,)
NEEDS_BOTH = BOTH_STORES

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


# -- the app and its stores ----------------------------------------------------------


def app_of(ctx: click.Context) -> Celery:
    """The Celery app: Celery's own ``-A``, or the console script's."""
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("no Celery app: pass -A/--app")
    return app


def runtime_of(ctx: click.Context) -> ToolRuntime:
    """The app's runtime, once each store the command needs answers a PING (else
    one line that names the store, and exit code 1)."""
    runtime = runtime_for(app_of(ctx))
    problem = store_problem(runtime, getattr(ctx.command, "needs", ()))
    if problem:
        fail(problem)
    return runtime


def operations_of(ctx: click.Context) -> DeadLetterOperations:
    """The app's dead-letter operations, once the stores the command needs answer."""
    return DeadLetterOperations(app_of(ctx), runtime_of(ctx))


class StoreCommand(click.Command):
    """A command that ends with one line on stderr and exit code 1, never a
    traceback, when a store it needs is down or refuses, the broker is down, or
    the app's settings are invalid (the line says which, see
    :func:`~celery_tooleffect.admin.operations.explain`).

    ``needs``: the stores it uses (:data:`NEEDS_STORE`, :data:`NEEDS_DEAD_LETTERS`).
    Each is PINGed when the command first reaches for the store (after its usage
    checks), so a store that is away is named before anything is done, not once
    per task.
    """

    def __init__(self, *args: Any, needs: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.needs = needs

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            problem = explain(app_of(ctx), exc, self.needs or NEEDS_BOTH)
            if problem is None:
                raise
            fail(problem)


class ToolEffectGroup(click.Group):
    """A group whose commands are :class:`StoreCommand` (and sub-groups, such groups)."""

    command_class = StoreCommand
    group_class = type


# -- answering -----------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """``message`` on stderr, and exit code 1."""
    click.echo(message, err=True)
    sys.exit(EXIT_REFUSED)


def wide_option(command: Any) -> Any:
    """``--wide``: the table with every column and nothing cut (see
    :mod:`celery_tooleffect.admin.table`), however wide that is."""
    return click.option(
        "--wide", is_flag=True,
        help="Print every column, nothing cut, however wide the lines get (without it the "
             "table fits the terminal, $COLUMNS, else 80 columns: ids and tool names are "
             "never cut, less important columns are left out first).",
    )(command)


def echo_json(data: Any) -> None:
    """``data`` as the commands' ``--json`` print it: indented, keys sorted, every
    invisible or text-reordering character a JSON escape (the same JSON value)."""
    click.echo(visible_json(data, indent=2))


def when(timestamp: float | str | None) -> str:
    """A unix time as ``YYYY-MM-DD HH:MM:SSZ`` (UTC)."""
    try:
        moment = datetime.fromtimestamp(float(timestamp or 0), tz=timezone.utc)
    except (TypeError, ValueError):
        return str(timestamp or "")
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def report(results: Iterable[ActionResult], as_json: bool, done_word: str) -> None:
    """Print an action's results (one line each, or ``--json``); exit code 1 unless
    every one is done."""
    if as_json:
        listed = list(results)
        echo_json(results_summary(listed))
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
