"""``tools``: the tools live workers declare, each effect, and the workers (and
releases) declaring it; a disagreement during a rolling upgrade is a conflict."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterable
from typing import Any

import click

from ...store.declarations import EffectDeclarations, by_tool
from ..table import render, terminal_width
from .base import EXIT_REFUSED, NEEDS_STORE, StoreCommand, echo_json, runtime_of, wide_option


@click.command("tools", cls=StoreCommand, needs=NEEDS_STORE,
               short_help="The tools live workers declare, with their effects.")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"tools": [...], "workers": [...], "conflicts": [...]} '
                   "(stable, see docs/operations.md#json-output).")
@wide_option
@click.pass_context
def tools_command(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """List the tools live workers declare: each effect, and the workers (and
    releases) declaring it. Exit code 1 when live workers disagree about a
    tool's effect (a rolling upgrade that changes it: each call is then handled
    under the strictest effect its journal recorded).

    The table keeps the tool's name whole at any width; the other columns are
    left out, least important first, when they do not fit (--wide prints
    them all)."""
    workers = EffectDeclarations(runtime_of(ctx).settings).live()
    tools = by_tool(workers)
    conflicts = [tool for tool in tools if tool.conflict]
    if as_json:
        echo_json({
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
        rows = []
        for tool in tools:
            for effect in tool.effects:
                declarers = [d for d in tool.declarers if d.effect == effect]
                rows.append([tool.name, effect, _releases(declarers), str(len(declarers)),
                             ", ".join(d.worker for d in declarers),
                             "CONFLICT" if tool.conflict else ""])
        click.echo(render(["TOOL", "EFFECT", "RELEASE", "WORKERS", "DECLARED BY", "NOTE"], rows,
                          shrink=["DECLARED BY", "RELEASE"],
                          optional=["DECLARED BY", "WORKERS", "RELEASE"], wide=wide, hint=True))
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

