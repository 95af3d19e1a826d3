"""The benchmark's tables (Markdown, as in ``bench/README.md``) and the machine they ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata

from celery_tooleffect.testing import redis_server_binary

from .app import VARIANTS
from .calls import ONE_REDIS, VariantFigures
from .store_scale import Timed

BASELINE = next(iter(VARIANTS))
#: Store round trips the design needs for one successful call: one per
#: journal transition (intent, outcome) for a write, the fail-soft audit
#: append for a read; a deadline adds securing the broker lease.
#: With one Redis for broker, result backend and store ("one redis"), the
#: read's audit append stores Celery's result (the backend's GET and SET are
#: saved), a write's outcome does, and the intent secures the broker lease:
#: round trips beside the baseline's.
DESIGN_MINIMUM = {
    BASELINE: {"store": 0, "broker extra": 0, "one redis": 0},
    "READ_ONLY": {"store": 1, "broker extra": 0, "one redis": -1},
    "IDEMPOTENT_WRITE": {"store": 2, "broker extra": 0, "one redis": 0},
    "NON_IDEMPOTENT_WRITE": {"store": 2, "broker extra": 0, "one redis": 0},
    "NON_IDEMPOTENT_WRITE + deadline": {"store": 2, "broker extra": 1, "one redis": 0},
}


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def calls_table(figures: dict[str, VariantFigures], peer: VariantFigures | None = None) -> str:
    """Throughput and latency of every variant, and of the ``peer`` row (DBOS)."""
    base = figures[BASELINE]
    rows = []
    for variant, figure in [*figures.items(), *([(peer.variant, peer)] if peer else [])]:
        rows.append([
            variant,
            f"{figure.throughput:,.0f}",
            f"{figure.throughput / base.throughput:.3f}",
            " ".join(f"{round_.per_second:,.0f}" for round_ in figure.rounds),
            f"{figure.latency(50):.2f}",
            f"{figure.latency(99):.2f}",
            f"{figure.latency(99) - base.latency(99):+.2f}",
        ])
    return table(["variant", "calls/s (median)", "ratio to baseline", "rounds (calls/s)",
                  "latency p50 ms", "p99 ms", "added p99 ms"], rows)


def cpu_table(figures: dict[str, VariantFigures]) -> str:
    """Where the time goes: CPU per call by process, beside the baseline's."""
    base = figures[BASELINE]
    parts = ("worker main", "pool", "redis")
    rows = []
    for variant, figure in figures.items():
        total = sum(figure.cpu_us(part) for part in parts)
        base_total = sum(base.cpu_us(part) for part in parts)
        rows.append([variant] + [
            f"{figure.cpu_us(part):.0f} ({figure.cpu_us(part) - base.cpu_us(part):+.0f})"
            for part in parts
        ] + [f"{total:.0f} ({total - base_total:+.0f})"])
    return table(["variant", "worker main process", "pool processes", "redis-server",
                  "all"], rows)


def round_trips_table(figures: dict[str, VariantFigures]) -> str:
    base = figures[BASELINE]
    rows = []
    for variant, figure in figures.items():
        trips = figure.round_trips
        if not trips:
            continue
        minimum = DESIGN_MINIMUM[variant]
        broker_extra = trips["broker"] - base.round_trips["broker"]
        commands = sum(figure.commands.values())
        scripts = figure.commands.get("evalsha", 0.0)
        apart = sum(value for role, value in trips.items() if role != ONE_REDIS)
        one = trips.get(ONE_REDIS)
        one_base = base.round_trips.get(ONE_REDIS)
        rows.append([
            variant,
            f"{trips['broker']:.2f} ({broker_extra:+.2f})",
            f"{trips['backend']:.2f}",
            f"{trips['store']:.2f}",
            f"{minimum['store']}" + (f" + {minimum['broker extra']} broker"
                                     if minimum["broker extra"] else ""),
            f"{apart:.2f}",
            f"{commands:.1f} ({scripts:.0f} script{'' if round(scripts) == 1 else 's'})",
            "-" if one is None or one_base is None else
            f"{one:.2f} ({one - one_base:+.2f}; design {minimum[ONE_REDIS]:+d})",
        ])
    return table(["variant", "broker (vs baseline)", "result backend", "tooleffect store",
                  "store minimum (design)", "all round trips", "Redis commands",
                  "one Redis: all round trips (vs baseline)"], rows)


def commands_detail(figures: dict[str, VariantFigures]) -> str:
    lines = []
    for variant, figure in figures.items():
        if figure.commands:
            listed = ", ".join(f"{name} {count:.1f}" for name, count in
                               sorted(figure.commands.items(), key=lambda item: -item[1]))
            lines.append(f"- {variant}: {listed}")
    return "\n".join(lines)


def operations_table(timed: Sequence[Timed]) -> str:
    rows = []
    for entry in timed:
        rows.append([
            entry.operation,
            "" if entry.in_process_ms is None else f"{entry.in_process_ms:.2f}",
            "" if entry.process_seconds is None else f"{entry.process_seconds:.2f}",
            "" if entry.peak_rss_mb is None else f"{entry.peak_rss_mb:.1f}",
            entry.note,
        ])
    return table(["operation", "in process (ms, median)", "CLI process (s, best of 3)",
                  "CLI peak memory (MiB)", "note"], rows)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def machine() -> str:
    """One line on the machine and the versions the run used."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        memory = "? GiB"
    server = subprocess.run([redis_server_binary(), "--version"], capture_output=True,
                            text=True, check=False).stdout.split()
    redis_version = next((word.split("=", 1)[1] for word in server if word.startswith("v=")),
                         "?")
    versions = ", ".join(f"{name} {_version(name)}"
                         for name in ("celery", "kombu", "redis", "hiredis"))
    return (f"{cpu}, {os.cpu_count()} cores, {memory}; Linux {platform.release()}; "
            f"Python {platform.python_version()}, {versions}, redis-server {redis_version}")
