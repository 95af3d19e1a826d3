"""The benchmark's tables (Markdown, as in ``bench/README.md``) and the machine they ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata

from celery_tooleffect.testing import redis_server_binary

from .app import BASELINE, PLAIN_ATOMIC
from .calls import ONE_REDIS, VariantFigures
from .store_scale import Timed

#: Round trips of one successful call, from its fetch to its acknowledgement,
#: by role, as the design counts them from the commands each step sends (a
#: MULTI/EXEC or a pipeline is one round trip, a script is one).
#:
#: Per role (broker, result backend and store at three addresses: no store
#: script may touch the broker's or the backend's keys, so nothing is folded):
#:
#: - broker: kombu's fetch is ``BRPOP`` and then ``QoS.append`` (``ZADD
#:   unacked_index`` + ``HSET unacked`` in one MULTI): 2; the atomic fetch is
#:   one script: 1. The acknowledgement (``ZREM`` + ``HDEL`` in one MULTI): 1.
#:   A deadline's broker lease, secured before the body: 1 more.
#: - result backend: Celery's ``GET`` of the stored meta (it will not overwrite
#:   a SUCCESS), then ``SETEX`` + ``PUBLISH`` in one pipeline: 2.
#: - store: a read's fail-soft audit append: 1; a write's intent and outcome: 2.
#:
#: One Redis for all three (the common deployment, the throughput rounds'): the
#: store's scripts carry what they can. A read's audit append stores Celery's
#: result and acknowledges the message: fetch 1 + append 1 = 2. A write's
#: intent secures a deadline's lease, its outcome stores the result and
#: acknowledges: fetch 1 + intent 1 + outcome 1 = 3. Plain Celery folds
#: nothing: kombu's fetch 2 + backend 2 + ack 1 = 5; with the atomic fetch 4.
DESIGN = {
    BASELINE: {"broker": 3, "backend": 2, "store": 0, ONE_REDIS: 5},
    PLAIN_ATOMIC: {"broker": 2, "backend": 2, "store": 0, ONE_REDIS: 4},
    "READ_ONLY": {"broker": 2, "backend": 2, "store": 1, ONE_REDIS: 2},
    "IDEMPOTENT_WRITE": {"broker": 2, "backend": 2, "store": 2, ONE_REDIS: 3},
    "NON_IDEMPOTENT_WRITE": {"broker": 2, "backend": 2, "store": 2, ONE_REDIS: 3},
    "NON_IDEMPOTENT_WRITE + deadline": {"broker": 3, "backend": 2, "store": 2, ONE_REDIS: 3},
}
#: The per-role counts (the one-Redis count is kept apart).
ROLES = ("broker", "backend", "store")

#: The issue's targets against the baseline, trivial bodies, one Redis, same
#: run (reported, not asserted): the least ratio of calls/s of each variant.
RATIO_TARGETS = {
    "READ_ONLY": 1.05,
    "IDEMPOTENT_WRITE": 0.95,
    "NON_IDEMPOTENT_WRITE": 0.95,
    "NON_IDEMPOTENT_WRITE + deadline": 0.90,
}
#: With bodies that wait (``--body-ms 5``): every variant's least ratio.
BODY_RATIO_TARGET = 0.98
#: Trivial bodies: the most p99 latency any variant may add to the baseline's.
ADDED_P99_TARGET_MS = 1.0
#: The effects, whose round trips the targets bound (one Redis): a read fewer
#: than the baseline's, a write no more.
READS = ("READ_ONLY",)
WRITES = ("IDEMPOTENT_WRITE", "NON_IDEMPOTENT_WRITE", "NON_IDEMPOTENT_WRITE + deadline")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


CPU_PARTS = ("worker main", "pool", "redis")


def _cpu_total(figure: VariantFigures) -> float:
    return sum(figure.cpu_us(part) for part in CPU_PARTS)


def summary_table(figures: dict[str, VariantFigures], peer: VariantFigures | None = None) -> str:
    """One row per variant (and the peer's): round trips on one Redis, calls/s,
    the ratio to the baseline (plain Celery, kombu's fetch), latency and CPU per
    call; "-" where the phase that measures it did not run."""
    base = figures[BASELINE]
    rows = []
    for variant, figure in [*figures.items(), *([(peer.variant, peer)] if peer else [])]:
        one = figure.round_trips.get(ONE_REDIS)
        one_base = base.round_trips.get(ONE_REDIS)
        rounds = bool(figure.rounds) and bool(base.rounds)
        latencies = bool(figure.latencies_ms) and bool(base.latencies_ms)
        cpu = rounds and all(part in figure.rounds[0].cpu_us for part in CPU_PARTS)
        rows.append([
            variant,
            "-" if one is None else
            f"{one:.2f}" + ("" if one_base is None else f" ({one - one_base:+.2f})"),
            f"{figure.throughput:,.0f}" if figure.rounds else "-",
            f"{figure.throughput / base.throughput:.3f}" if rounds else "-",
            f"{figure.latency(50):.2f}" if figure.latencies_ms else "-",
            f"{figure.latency(99):.2f}" if figure.latencies_ms else "-",
            f"{figure.latency(99) - base.latency(99):+.2f}" if latencies else "-",
            f"{_cpu_total(figure):,.0f} ({_cpu_total(figure) - _cpu_total(base):+,.0f})"
            if cpu else "-",
        ])
    return table(["variant", "round trips, one Redis (vs baseline)", "calls/s (median)",
                  "ratio to baseline", "latency p50 ms", "p99 ms", "added p99 ms",
                  "CPU us per call (vs baseline)"], rows)


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
    rows = []
    for variant, figure in figures.items():
        rows.append([variant] + [
            f"{figure.cpu_us(part):.0f} ({figure.cpu_us(part) - base.cpu_us(part):+.0f})"
            for part in CPU_PARTS
        ] + [f"{_cpu_total(figure):.0f} ({_cpu_total(figure) - _cpu_total(base):+.0f})"])
    return table(["variant", "worker main process", "pool processes", "redis-server",
                  "all"], rows)


def round_trips_table(figures: dict[str, VariantFigures]) -> str:
    """Counted round trips by role, the design's in brackets; on one Redis, the
    total beside the design's and the baseline's."""
    base = figures[BASELINE]
    rows = []
    for variant, figure in figures.items():
        trips = figure.round_trips
        if not trips:
            continue
        design = DESIGN[variant]
        commands = sum(figure.commands.values())
        scripts = figure.commands.get("evalsha", 0.0)
        one = trips.get(ONE_REDIS)
        one_base = base.round_trips.get(ONE_REDIS)
        per_role = all(role in trips for role in ROLES)
        rows.append([
            variant,
            *(f"{trips[role]:.2f} ({design[role]})" if role in trips else "-"
              for role in ROLES),
            f"{sum(trips[role] for role in ROLES):.2f} "
            f"({sum(design[role] for role in ROLES)})" if per_role else "-",
            f"{commands:.1f} ({scripts:.0f} script{'' if round(scripts) == 1 else 's'})"
            if figure.commands else "-",
            "-" if one is None else
            f"{one:.2f} ({design[ONE_REDIS]})" + ("" if one_base is None else
                                                  f"; {one - one_base:+.2f}"),
        ])
    return table(["variant", "broker (design)", "result backend (design)",
                  "tooleffect store (design)", "all round trips, per role (design)",
                  "Redis commands", "one Redis: all round trips (design; vs baseline)"], rows)


@dataclass
class Target:
    """One of the issue's targets, as this run measured it."""

    target: str
    measured: str
    #: None: not measured in this run (its phase did not run).
    met: bool | None
    margin: str = ""


def _ratio_target(figures: dict[str, VariantFigures], variant: str, least: float,
                  label: str) -> Target:
    figure, base = figures[variant], figures[BASELINE]
    if not figure.rounds or not base.rounds:
        return Target(label, "not measured", None)
    ratio = figure.throughput / base.throughput
    return Target(label, f"{ratio:.3f}", ratio >= least,
                  f"{ratio - least:+.3f} ({'over' if ratio >= least else 'short'})")


def target_checks(figures: dict[str, VariantFigures], body_ms: float = 0.0) -> list[Target]:
    """The issue's targets against the baseline, met or missed with the margin.

    Trivial bodies (``body_ms`` 0): the ratios of :data:`RATIO_TARGETS` and an
    added p99 under :data:`ADDED_P99_TARGET_MS` for every variant; bodies that
    wait: every variant at least :data:`BODY_RATIO_TARGET`. Either way the
    round trips on one Redis: a read fewer than the baseline's, a write no more.
    """
    checks: list[Target] = []
    others = [variant for variant in figures if variant != BASELINE]
    base = figures[BASELINE]
    if body_ms:
        for variant in others:
            checks.append(_ratio_target(
                figures, variant, BODY_RATIO_TARGET,
                f"{variant}: calls/s at least {BODY_RATIO_TARGET:.2f} of the baseline "
                f"({body_ms:g} ms bodies)"))
    else:
        for variant, least in RATIO_TARGETS.items():
            checks.append(_ratio_target(figures, variant, least,
                                        f"{variant}: calls/s at least {least:.2f} of the "
                                        "baseline"))
        for variant in others:
            label = f"{variant}: added p99 under {ADDED_P99_TARGET_MS:g} ms"
            figure = figures[variant]
            if not figure.latencies_ms or not base.latencies_ms:
                checks.append(Target(label, "not measured", None))
                continue
            added = figure.latency(99) - base.latency(99)
            met = added < ADDED_P99_TARGET_MS
            checks.append(Target(label, f"{added:+.2f} ms", met,
                                 f"{ADDED_P99_TARGET_MS - added:+.2f} ms "
                                 f"({'to spare' if met else 'over'})"))
    base_trips = base.round_trips.get(ONE_REDIS)
    plain = figures[PLAIN_ATOMIC].round_trips.get(ONE_REDIS) if PLAIN_ATOMIC in figures \
        else None
    for variant in (*READS, *WRITES):
        read = variant in READS
        label = (f"{variant}: round trips on one Redis "
                 + ("fewer than the baseline's" if read else "no more than the baseline's"))
        trips = figures[variant].round_trips.get(ONE_REDIS)
        if trips is None or base_trips is None:
            checks.append(Target(label, "not measured", None))
            continue
        # Counts are whole numbers give or take the batches' noise.
        allowed = base_trips - 1 if read else base_trips
        met = trips <= allowed + 0.5
        checks.append(Target(
            label,
            f"{trips:.2f} (baseline {base_trips:.2f}"
            + ("" if plain is None else f"; plain celery, atomic fetch {plain:.2f}") + ")",
            met, f"{allowed - trips:+.2f} round trips ({'to spare' if met else 'over'})"))
    return checks


def targets_table(checks: Sequence[Target]) -> str:
    rows = [[check.target, check.measured,
             "-" if check.met is None else ("yes" if check.met else "**no**"), check.margin]
            for check in checks]
    return table(["target (against plain celery, kombu's fetch)", "measured", "met",
                  "margin"], rows)


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
