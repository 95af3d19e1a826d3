"""``store``: how durable the store and the dead-letter store are, their replicas
in sync, and the last rollback of the store the workers found
(``docs/redis.md#durability``); with ``--sizing``, how big the store is and
will be at the current rate (``docs/redis.md#sizing-the-store``)."""

from __future__ import annotations

import datetime
from typing import Any

import click

from ...errors import PersistenceUnreadable
from ...store.durability import Durability
from ...store.keys import Keys
from ...store.persistence import read_persistence
from ...store.servers import JOURNAL, ROLES, online_replicas, servers_of
from ..sizing import (
    NOT_THE_PACKAGES,
    RATE_WINDOW,
    SAMPLE_KEYS,
    SAMPLE_RUNS,
    Sizing,
    days,
    human_bytes,
    measure_store,
)
from ..table import render
from .base import NEEDS_BOTH, StoreCommand, app_of, echo_json, runtime_of, wide_option

#: What each mode loses, by what goes down (the table of docs/redis.md#durability).
LOSES = {
    "aof_always": ("nothing", "nothing"),
    "aof_everysec": ("nothing", "up to 1 s of writes"),
    "aof_no": ("nothing", "up to ~30 s of writes"),
    "aof": ("nothing", "unknown (fsync not read)"),
    "rdb": ("writes since the last snapshot", "the same"),
    "none": ("everything", "everything"),
}


@click.command("store", cls=StoreCommand, needs=NEEDS_BOTH,
               short_help="The store's durability, replicas, rollbacks and sizing.")
@click.option("--json", "as_json", is_flag=True,
              help='Print JSON: {"servers": [...], "replicas": {...}, "rollback": {...} | null'
                   '[, "sizing": {...}]}.')
@click.option("--sizing", is_flag=True,
              help="Also report the store's memory, its keys by kind, the bytes a call leaves "
                   "by effect, and the memory projected at the current call rate for the "
                   "retention (bounded reads: --sample, --runs, --window).")
@click.option("--sample", type=click.IntRange(min=1), default=SAMPLE_KEYS, show_default=True,
              help="Keys SCAN reads at most for --sizing (a bigger store is extrapolated).")
@click.option("--runs", type=click.IntRange(min=0), default=SAMPLE_RUNS, show_default=True,
              help="Runs whose calls are measured at most for --sizing.")
@click.option("--window", type=click.IntRange(min=1), default=RATE_WINDOW, show_default=True,
              help="Newest entries of the global audit stream the call rate is read from.")
@wide_option
@click.pass_context
def store_command(ctx: click.Context, as_json: bool, sizing: bool, sample: int, runs: int,
                  window: int, wide: bool) -> None:
    """Show how durable the store and the dead-letter store are (what a crash of
    the process or of the machine loses), the store's replicas in sync, and
    when the workers last found the store rolled back.

    A worker refuses to start on a server that loses acknowledged writes when
    its process restarts, unless replicas are waited for or
    tooleffect_allow_volatile_store is True (docs/redis.md#durability).

    With --sizing: the store's used memory and maxmemory, its keys by kind, the
    bytes a call leaves by effect (measured on the runs there), and the memory
    projected at the current call rate for tooleffect_retention, with a warning
    when it passes maxmemory (docs/redis.md#sizing-the-store)."""
    runtime = runtime_of(ctx)
    measured = (measure_store(app_of(ctx), runtime, sample=sample, runs=runs, window=window)
                if sizing else None)
    settings = runtime.settings
    servers = []
    for server in servers_of(runtime.audit.client, runtime.dead_letters.client):
        row: dict[str, Any] = {"address": server.address, "roles": list(server.roles)}
        try:
            persistence = read_persistence(server.client)
        except PersistenceUnreadable as exc:
            row.update(mode=None, source=None, error=str(exc))
        else:
            row.update(mode=persistence.mode.value, source=persistence.source, error=None,
                       describe=persistence.mode.describe())
        servers.append(row)
    durability = Durability.of(settings)
    store_client = next((server.client for server in servers_of(runtime.audit.client, None)),
                        None)
    in_sync = online_replicas(store_client) if store_client is not None else 0
    replicas = {"in_sync": in_sync, "wanted": durability.replicas if durability else 0,
                "fsync": bool(durability and durability.fsync)}
    marker = {} if settings.redis_cluster else runtime.audit.client.hgetall(
        Keys(settings.key_prefix).rollback)
    rollback: dict[str, Any] | None = None
    if marker:
        fields = {_text(key): _text(value) for key, value in marker.items()}
        rollback = {"detected_at": float(fields.get("detected_at", 0)),
                    "writer": fields.get("writer", ""),
                    "acknowledged": int(fields.get("acknowledged", 0)),
                    "found": int(fields.get("found", 0))}
    if as_json:
        data = {"servers": [{k: v for k, v in row.items() if k != "describe"}
                            for row in servers],
                "replicas": replicas, "rollback": rollback}
        if measured is not None:
            data["sizing"] = measured.as_json()
        echo_json(data)
        return
    rows = []
    for row in servers:
        roles = " and ".join(ROLES[role].removeprefix("the ") for role in row["roles"])
        if row["mode"] is None:
            rows.append([row["address"], roles, "unreadable", "?", "?"])
            continue
        process, machine = LOSES[row["mode"]]
        rows.append([row["address"], roles, row["describe"], process, machine])
    click.echo(render(["SERVER", "ROLE", "PERSISTENCE", "A PROCESS CRASH LOSES",
                       "A MACHINE CRASH LOSES"], rows,
                      shrink=["ROLE", "PERSISTENCE"], optional=["A MACHINE CRASH LOSES"],
                      wide=wide, hint=True))
    for row in servers:
        if row["error"]:
            click.echo(f"\n{row['address']}: persistence not readable: {row['error']}")
    click.echo(f"\nReplicas of the {ROLES[JOURNAL].removeprefix('the ')} in sync: "
               f"{replicas['in_sync']} (tooleffect_store_replicas asks {replicas['wanted']}"
               f"{', with fsync' if replicas['fsync'] else ''})")
    if settings.redis_cluster:
        click.echo("Rollbacks: not watched on a Redis Cluster store.")
    elif rollback is None:
        click.echo("Rollbacks: none found.")
    else:
        when = datetime.datetime.fromtimestamp(rollback["detected_at"], datetime.timezone.utc)
        click.echo(f"Rollbacks: last found {when:%Y-%m-%d %H:%M:%S} UTC by "
                   f"{_process(rollback['writer'])} "
                   f"(the store held {rollback['found']} of the {rollback['acknowledged']} "
                   "intents it had acknowledged to that process); non-idempotent writes "
                   "published before then that find no journal entry are reconciled or "
                   "dead-lettered store_rolled_back.")
    if measured is not None:
        _echo_sizing(measured, wide)


def _echo_sizing(sizing: Sizing, wide: bool) -> None:
    """The ``--sizing`` section."""
    limit = f"maxmemory {human_bytes(sizing.maxmemory)}" if sizing.maxmemory else "no maxmemory"
    click.echo(f"\nSizing of the store {sizing.server}: used memory "
               f"{human_bytes(sizing.used_memory)}, {limit} "
               f"(policy {sizing.maxmemory_policy or '?'}); {sizing.total_keys} keys, "
               f"{sizing.scanned} sampled.")
    rows = [[size.kind, str(size.keys), human_bytes(size.bytes),
             human_bytes(size.sampled_bytes / size.sampled) if size.sampled else "-"]
            if size.kind != NOT_THE_PACKAGES else [size.kind, str(size.keys), "-", "-"]
            for size in sizing.kinds.values() if size.keys or size.bytes]
    click.echo(render(["KIND", "KEYS", "BYTES", "PER KEY"], rows, wide=wide))
    if sizing.effects:
        rows = [[size.effect, str(size.calls), f"{size.bytes_per_call} B"]
                for size in sizing.effects.values()]
        if sizing.results.calls:
            rows.append(["(Celery result)", str(sizing.results.calls),
                         f"{sizing.results.bytes_per_call} B"])
        click.echo("\nBytes per call, measured on the runs there:")
        click.echo(render(["EFFECT", "CALLS", "BYTES PER CALL"], rows, wide=wide))
    else:
        click.echo("\nBytes per call: no run to measure.")
    if sizing.bytes_per_global_event:
        click.echo(f"Global stream: {sizing.bytes_per_global_event} B per event "
                   f"(capped at {sizing.global_stream_maxlen} events).")
    letters = sizing.dead_letters
    if letters.letters:
        where = "" if letters.in_the_store else ", in the dead-letter store (the broker's Redis)"
        click.echo(f"Dead letters: {letters.letters}, {human_bytes(letters.bytes)} "
                   f"({letters.bytes_per_letter} B per letter{where}); they do not expire.")
    click.echo(f"\nRate: {sizing.calls_per_second:g} calls/s (over the last "
               f"{sizing.rate_window_seconds:g} s); a call's keys live "
               f"{days(sizing.retention_seconds)}. Projected memory: "
               f"{human_bytes(sizing.projected_memory)}.")
    for warning in sizing.warnings:
        click.echo(f"WARNING: {warning}")


def _process(writer_key: str) -> str:
    """``host (pid N)`` of a writer key (``<prefix>store:writer:<host>:<pid>:<random>``)."""
    parts = writer_key.rsplit(":", 3)
    return f"{parts[-3]} (pid {parts[-2]})" if len(parts) == 4 else "?"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
