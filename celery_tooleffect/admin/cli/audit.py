"""``audit``: the audit trails: one run's events (``show``), their chain
(``verify``, against a ``head`` exported earlier), the newest events of all
runs (``tail``, ``--follow``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import click

from ...events import AuditEvent
from ...store.audit import copied_fields, entry_order, text
from ..table import layout, render, terminal_width
from ..visible import visible_json
from .base import (
    EXIT_REFUSED,
    NEEDS_STORE,
    ToolEffectGroup,
    echo_json,
    fail,
    runtime_of,
    when,
    wide_option,
)

#: Where the ``--json`` forms are documented.
JSON_DOCS = "stable, see docs/operations.md#json-output"


@click.group(cls=ToolEffectGroup, short_help="Audit trails: show, verify, head, tail.")
def audit() -> None:
    """Audit trails: one run's events (show), its chain (verify), its head to
    keep outside Redis (head), or the newest events of all runs (tail)."""


_EVENT_HEADERS = ["SEQ", "TIME (UTC)", "TASK ID", "TOOL", "PHASE", "STATUS", "TRY", "CLASS",
                  "EXCEPTION", "BY"]
#: ``audit show``'s columns that may be left out, least important first: the
#: time, the task id, the phase and the status are always there (what an
#: operator reads first), the tool next when it fits whole.
_EVENT_OPTIONAL = ["BY", "SEQ", "EXCEPTION", "CLASS", "TRY", "TOOL"]


def _event_row(event: Mapping[str, str], clock: bool = False) -> list[str]:
    moment = when(event.get("ts"))
    return [
        event.get("seq", ""), moment[11:19] if clock else moment, event.get("task_id", ""),
        event.get("tool", ""), event.get("phase", ""), event.get("status", ""),
        event.get("attempt", ""), event.get("failure_class", ""),
        event.get("exception_type", ""), event.get("actor") or event.get("worker", ""),
    ]


def event_table(events: Sequence[Mapping[str, str]], *, width: int | None = None,
                wide: bool = False) -> str:
    """``audit show``'s table of one run's events, fitting ``width``: the time,
    the task id, the phase and the status at any width; the time of a run whose
    events all fall on one UTC day as ``HH:MM:SS`` under a line naming the day
    (``--wide``: every column and the full time)."""
    days = {when(event.get("ts"))[:10] for event in events}
    clock = not wide and len(days) == 1
    headers = list(_EVENT_HEADERS)
    if clock:
        headers[1] = "UTC"
    table = render(headers, [_event_row(event, clock) for event in events], width=width,
                   shrink=["BY", "EXCEPTION"], optional=_EVENT_OPTIONAL, wide=wide, hint=True)
    return f"{days.pop()} (UTC)\n{table}" if clock else table


@audit.command("show", needs=NEEDS_STORE)
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"run_id", "events": [...]}, each event its stored fields '
                   f"as text, its seq as id, and the chain's links ({JSON_DOCS}).")
@wide_option
@click.pass_context
def audit_show(ctx: click.Context, run_id: str, as_json: bool, wide: bool) -> None:
    """Show the audit events of one run, oldest first.

    The table keeps the time, the task id, the phase and the status at any
    width (the time as HH:MM:SS under the day's date when the run's events fall
    on one day); the tool, whole, and the other columns are left out, least
    important first, when they do not fit (--wide prints them all).
    """
    events = runtime_of(ctx).audit.events(run_id)
    if as_json:
        # Each event as stored: its fields' text, not parsed.
        echo_json({"run_id": run_id, "events": [dict(event) for event in events]})
        if not events:
            sys.exit(EXIT_REFUSED)
        return
    if not events:
        fail(f"{run_id}: no audit events for this run")
    click.echo(event_table(events, wide=wide))


def _head_value(ctx: click.Context, param: click.Parameter,
                value: str | None) -> tuple[int, str] | None:
    """``--head SEQ:HASH`` as (seq, hash)."""
    if value is None:
        return None
    seq, _, link = value.partition(":")
    if not seq.isdigit() or len(link) != 40 or any(c not in "0123456789abcdef" for c in link):
        raise click.BadParameter("give SEQ:HASH as `audit head` printed it "
                                 "(a number, a colon, 40 hex digits)")
    return int(seq), link


@audit.command("verify", needs=NEEDS_STORE)
@click.argument("run_ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Verify every run in the store.")
@click.option("--head", "exported", metavar="SEQ:HASH", callback=_head_value,
              help="A head `audit head` exported earlier: the run's chain must still lead "
                   "to it (one RUN_ID only).")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"runs": [{"run_id", "events", "intact", "broken_at", '
                   f'"problem", "keyed", "head"}}]}} ({JSON_DOCS}).')
@click.pass_context
def audit_verify(ctx: click.Context, run_ids: tuple[str, ...], every: bool,
                 exported: tuple[int, str] | None, as_json: bool) -> None:
    """Check the chain of runs' audit events; report the first broken link.

    With tooleffect_audit_key set, each event's keyed MAC is checked too (an
    event edited or forged without the key); with --head, the chain must
    still lead to a head exported earlier (events up to it removed, moved or
    inserted, even by someone who recomputed the chain). See
    docs/operations.md#audit-verify for what is detected and what cannot be.

    Exit code 0 when every chain is intact, 1 when one is broken or a run has
    no events.
    """
    if bool(run_ids) == every:
        raise click.UsageError("give RUN_ID... or --all (not both)")
    if exported is not None and len(run_ids) != 1:
        raise click.UsageError("--head checks one RUN_ID")
    log = runtime_of(ctx).audit
    checks = [log.verify(run_id, head=exported)
              for run_id in (log.runs() if every else run_ids)]
    bad = [check for check in checks if not check.intact or check.events == 0]
    keyed = log.settings.audit_key is not None
    if as_json:
        echo_json({"runs": [
            {"run_id": c.run_id, "events": c.events, "intact": c.intact and c.events > 0,
             "broken_at": c.broken_at, "problem": c.problem or (None if c.events else
                                                                "no events"),
             "keyed": c.keyed, "head": f"{c.head_seq}:{c.head}" if c.head else None}
            for c in checks
        ]})
    else:
        for check in checks:
            if check.events == 0 and check.intact:
                click.echo(f"{check.run_id}: no events")
            elif check.intact:
                how = f", {check.keyed} keyed" if keyed else ", not keyed (no audit key set)"
                click.echo(f"{check.run_id}: intact ({check.events} events{how}"
                           f"{', leads to the exported head' if exported else ''})")
            else:
                click.echo(f"{check.run_id}: BROKEN at {check.broken_at}: {check.problem}")
        click.echo(f"{len(checks) - len(bad)} of {len(checks)} run(s) intact")
    if bad:
        sys.exit(EXIT_REFUSED)


@audit.command("head", needs=NEEDS_STORE)
@click.argument("run_ids", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True,
              help=f'Print JSON: {{"heads": [{{"run_id", "seq", "hash"}}]}} ({JSON_DOCS}).')
@click.pass_context
def audit_head(ctx: click.Context, run_ids: tuple[str, ...], as_json: bool) -> None:
    """Print each run's head, SEQ:HASH, to keep outside Redis.

    Later, `audit verify RUN_ID --head SEQ:HASH` finds any change to the
    run's events up to that seq, even by someone who could write to Redis
    and recomputed the chain. Exit code 1 when a run has no events.
    """
    log = runtime_of(ctx).audit
    heads = [(run_id, log.head(run_id)) for run_id in run_ids]
    if as_json:
        echo_json({"heads": [{"run_id": run_id, "seq": head[0] if head else None,
                              "hash": head[1] if head else None} for run_id, head in heads]})
    else:
        for run_id, head in heads:
            click.echo(f"{run_id} {head[0]}:{head[1]}" if head and head[1]
                       else f"{run_id}: no events")
    if any(head is None or not head[1] for _, head in heads):
        sys.exit(EXIT_REFUSED)


#: The tail's columns; the ids and the tool are never cut, the others are left
#: out, least important first (:data:`_TAIL_OPTIONAL`), when they do not fit.
_TAIL_HEADERS = ["TIME (UTC)", "RUN ID", "TASK ID", "TOOL", "PHASE", "STATUS", "CLASS", "BY"]
_TAIL_OPTIONAL = ["BY", "CLASS", "TIME (UTC)", "RUN ID"]
#: What ``--follow`` plans for when no event is shown first (later events are
#: laid out as the first ones): a task id and a run id as long as a UUID.
_TAIL_EXPECT = {"RUN ID": 36, "TASK ID": 36}


def _tail_row(event: Mapping[str, str]) -> list[str]:
    ts = event.get("ts", "")
    return [when(ts)[11:19] if ts and ts[0].isdigit() else ts, event.get("run_id", ""),
            event.get("task_id", ""), event.get("tool", ""), event.get("phase", ""),
            event.get("status", ""), event.get("failure_class", ""),
            event.get("actor") or event.get("worker", "")]


@audit.command("tail", needs=NEEDS_STORE)
@click.option("--count", "-n", type=click.IntRange(1, 10_000), default=20, show_default=True,
              help="How many of the newest events to show first.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events (Ctrl-C stops).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per line: the fields the global stream copies, as "
                   f"text, and its entry id, id ({JSON_DOCS}).")
@wide_option
@click.pass_context
def audit_tail(ctx: click.Context, count: int, follow: bool, as_json: bool,
               wide: bool) -> None:
    """Show the newest events of all runs (the global stream); --follow keeps going.

    The table keeps the task id and the tool whole at any width; the other
    columns are left out, least important first, when they do not fit
    (--wide prints them all). With --follow, new events are laid out as the
    first ones.
    """
    log = runtime_of(ctx).audit
    width = terminal_width()

    try:
        events = log.tail(count)
        rows = [_tail_row(event) for event in events]
        table = layout(_TAIL_HEADERS, rows, width=width, optional=_TAIL_OPTIONAL, wide=wide,
                       expect=_TAIL_EXPECT if follow and not events else None)

        def emit(event: AuditEvent) -> None:
            if as_json:
                # As the stream holds it: its fields' text, not parsed.
                click.echo(visible_json(dict(event)))
            else:
                click.echo(table.line(_tail_row(event)))

        if not as_json:
            for line in table.heading():
                click.echo(line)
        for event in events:
            emit(event)
        if not follow:
            if not as_json:
                for line in table.note(width):
                    click.echo(line)
            return
        last = (events[-1].entry_id or "$") if events else "$"
        client = log.client
        streams = log.keys.global_streams
        block = max(int(min(log.settings.socket_timeout * 500, 1000)), 100)
        if len(streams) > 1:
            _follow_shards(client, streams, last, block, emit)
        while True:
            replies: Any = client.xread({streams[0]: last}, block=block, count=100) or []
            for _stream, entries in replies:
                for entry_id, fields in entries:
                    last = text(entry_id)
                    emit(AuditEvent.from_stream(last, copied_fields(last, fields)))
            sys.stdout.flush()
    except KeyboardInterrupt:
        return



def _follow_shards(client: Any, streams: list[str], last: str, block_ms: int,
                   emit: Callable[[AuditEvent], None]) -> NoReturn:
    """Follow a cluster's global copy (store/keys.py, its shards): one ``XREAD``
    cannot name streams of several slots, so each shard is read without
    blocking from where it was last read, what came is shown in entry-id
    order, and the loop waits ``block_ms`` when nothing came."""
    positions = {}
    for stream in streams:
        newest = client.xrevrange(stream, count=1) if last == "$" else None
        positions[stream] = text(newest[0][0]) if newest else ("0-0" if last == "$" else last)
    while True:
        came = []
        for stream in streams:
            for _stream, entries in client.xread({stream: positions[stream]}, count=100) or []:
                for entry_id, fields in entries:
                    positions[stream] = text(entry_id)
                    came.append((entry_order(entry_id), text(entry_id), fields))
        for _order, entry_id, fields in sorted(came, key=lambda entry: entry[0]):
            emit(AuditEvent.from_stream(entry_id, copied_fields(entry_id, fields)))
        sys.stdout.flush()
        if not came:
            time.sleep(block_ms / 1000)
