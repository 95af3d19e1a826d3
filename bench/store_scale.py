"""The operator phases: dead letters at 100,000 and an audit read beside 1,000,000 events.

The data is written with the package's own scripts and clients (pipelined,
so that filling takes seconds), into the run's private redis-server. Each
operation is then timed twice:

- **in process**: the API call the CLI and the Flower page make
  (``DeadLetters.page``, ``get``, ``stats``; ``AuditLog.events``), median of
  repeated calls, after one warm-up call;
- **as a process**: the real CLI (``celery -A bench.app tooleffect ...``), its
  wall time and its peak resident memory (``bench.peak_memory``), best of
  three. Most of that is Python's and Celery's start-up, which ``--help``
  measures alone.

The CLI's memory is also measured with 1,000 letters, to show that it does not
grow with the number of letters.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters
from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.store.audit import StepContext, flatten, worker_identity
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.envelope import MessageEnvelope
from celery_tooleffect.store.lua import script

from .peak_memory import MARK
from .servers import ROOT

QUEUES = ("tools", "billing", "crm")
REASONS = ("not_retryable", "retries_exhausted", "interrupted_write", "unknown_task")
CLASSES = ("unknown", "auth", "connection", "rate_limit", "server_error")
EFFECTS = ("read_only", "idempotent_write", "non_idempotent_write")
#: The queue of the READ_ONLY letters the bulk replay takes.
REPLAY_QUEUE = "bench-replay"


def task_message(
    task_id: str, name: str, queue: str, args: list[Any], kwargs: dict[str, Any], *,
    run_id: str,
) -> MessageEnvelope:
    """A protocol 2 JSON task message as a worker receives it from Celery."""
    body = json.dumps([args, kwargs, {"callbacks": None, "errbacks": None, "chain": None,
                                      "chord": None}]).encode()
    headers: dict[str, Any] = {
        "lang": "py", "task": name, "id": task_id, "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0,
        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
        "argsrepr": repr(tuple(args)), "kwargsrepr": repr(kwargs),
        "origin": "gen1@bench", "ignore_result": False, "replaced_task_nesting": 0,
        "stamped_headers": None, "stamps": {}, "tooleffect_run_id": run_id,
    }
    return MessageEnvelope(
        body=body, content_type="application/json", content_encoding="utf-8",
        headers=headers, properties={"correlation_id": task_id, "reply_to": "bench",
                                     "delivery_mode": 2, "priority": 0},
        exchange="", routing_key=queue,
    )


def varied_letters(count: int, *, first: int = 0) -> Iterator[DeadLetter]:
    """``count`` dead letters spread over queues, reasons, classes and effects."""
    start = time.time() - first - count
    for number in range(first, first + count):
        reason = REASONS[number % 4]
        # Unknown task names are always the producer's fault (as in the package).
        failure_class = "client_error" if reason == "unknown_task" else CLASSES[number % 5]
        yield DeadLetter(
            task_id=f"{uuid.UUID(int=number)}", name=f"agent.tool_{number % 7}",
            queue=QUEUES[number % 3], reason=reason,
            failure_class=failure_class, effect=EFFECTS[(number // 3) % 3],
            message=task_message(f"{uuid.UUID(int=number)}", f"agent.tool_{number % 7}",
                                 QUEUES[number % 3], [f"customer-{number}", number],
                                 {"note": "x" * 40}, run_id=f"run-{number // 4}"),
            run_id=f"run-{number // 4}", exception_type="ProviderError",
            error=f"provider said no to request {number}", attempts=1 + number % 3,
            worker="host:1234", dead_lettered_at=start + number,
        )


def replayable_letters(count: int, task_name: str) -> Iterator[DeadLetter]:
    """``count`` READ_ONLY letters in :data:`REPLAY_QUEUE` that a bulk replay may take."""
    start = time.time() - count
    for number in range(count):
        task_id = uuid.uuid4().hex
        yield DeadLetter(
            task_id=task_id, name=task_name, queue=REPLAY_QUEUE,
            reason="retries_exhausted", failure_class="connection", effect="read_only",
            message=task_message(task_id, task_name, REPLAY_QUEUE, [number], {},
                                 run_id=f"replay-run-{number}"),
            run_id=f"replay-run-{number}", exception_type="ConnectionError",
            error="provider unreachable", attempts=4, worker="host:1234",
            dead_lettered_at=start + number,
        )


def fill_dead_letters(letters: DeadLetters, envelopes: Iterable[DeadLetter]) -> int:
    """Store ``envelopes`` with the package's store script, pipelined; how many."""
    store = script("dead_letter_store")
    client = letters.client
    client.script_load(store.text)
    pipe = client.pipeline(transaction=False)
    stored = 0
    for letter in envelopes:
        names, args = letters.store_arguments(letter)
        pipe.evalsha(store.sha, len(names), *names, *args)
        stored += 1
        if stored % 2000 == 0:
            pipe.execute()
    pipe.execute()
    return stored


@dataclass
class Timed:
    """One operation: in-process milliseconds, CLI process seconds and peak memory."""

    operation: str
    in_process_ms: float | None
    process_seconds: float | None = None
    peak_rss_mb: float | None = None
    note: str = ""


def in_process(action: Callable[[], Any], repeat: int = 20) -> float:
    """Median milliseconds of ``action`` after one warm-up call."""
    action()
    taken = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        taken.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(taken)


def cli(environment: dict[str, str], *args: str, repeat: int = 3) -> tuple[float, float]:
    """Best wall seconds and peak resident MiB of ``celery -A bench.app tooleffect ARGS``."""
    best_seconds, best_rss = float("inf"), float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "bench.peak_memory", "-m", "celery", "-A", "bench.app",
             "tooleffect", *args],
            env=environment, cwd=str(ROOT), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, check=False,
        )
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"tooleffect {' '.join(args)} exited {done.returncode}: "
                               f"{done.stderr[-2000:]}")
        peaks = [line.split()[1] for line in done.stderr.splitlines()
                 if line.startswith(MARK)]
        if not peaks:
            raise RuntimeError(f"tooleffect {' '.join(args)} did not report its memory")
        best_seconds = min(best_seconds, seconds)
        best_rss = min(best_rss, int(peaks[-1]) / 1024.0)
    return best_seconds, best_rss


def dead_letter_operations(app: Celery, environment: dict[str, str], *, letters_count: int,
                           replay_count: int, small_count: int,
                           progress: Callable[[str], None]) -> list[Timed]:
    """List, show, stats and a bulk replay, with ``letters_count`` dead letters stored."""
    letters = DeadLetters(app)
    timed: list[Timed] = []
    startup, startup_rss = cli(environment, "--help")
    timed.append(Timed("CLI start-up alone (`tooleffect --help`)", None, startup, startup_rss))

    fill_dead_letters(letters, varied_letters(small_count))
    small_list = cli(environment, "dlq", "list", "--limit", "50")
    small_stats = cli(environment, "dlq", "stats")

    started = time.perf_counter()
    fill_dead_letters(letters, varied_letters(letters_count - small_count - replay_count,
                                              first=small_count))
    fill_dead_letters(letters, replayable_letters(replay_count, "bench.read_only"))
    total = letters.stats().total
    if total != letters_count:
        raise RuntimeError(f"{total} dead letters stored, {letters_count} expected")
    progress(f"{letters_count:,} dead letters written in {time.perf_counter() - started:.1f}s")

    shown_id = str(uuid.UUID(int=small_count // 2))
    if letters.get(shown_id) is None:
        raise RuntimeError(f"dead letter {shown_id} not found")
    page = letters.page(limit=50)
    if len(page.letters) != 50 or page.total != letters_count:
        raise RuntimeError(f"a page of {len(page.letters)} of {page.total}")
    operations: list[tuple[str, Callable[[], Any], tuple[str, ...], float | None]] = [
        ("`dlq list --limit 50`", lambda: letters.page(limit=50),
         ("dlq", "list", "--limit", "50"), small_list[1]),
        ("`dlq show TASK_ID`", lambda: letters.get(shown_id), ("dlq", "show", shown_id), None),
        ("`dlq stats`", letters.stats, ("dlq", "stats"), small_stats[1]),
    ]
    for label, action, args, small_rss in operations:
        seconds, rss = cli(environment, *args)
        note = "" if small_rss is None else (
            f"peak memory with {small_count:,} letters: {small_rss:.1f} MiB")
        timed.append(Timed(label, in_process(action), seconds, rss, note))
        progress(f"{label}: {timed[-1].in_process_ms:.2f} ms in process, "
                 f"{seconds:.2f} s as a process, {rss:.1f} MiB")

    seconds, rss = cli(environment, "dlq", "replay", "--all", "--effect", "read_only",
                       "--queue", REPLAY_QUEUE, repeat=1)
    left = letters.stats().by_queue.get(REPLAY_QUEUE, 0)
    broker = letters.client
    published = int(broker.llen(f"{app.conf.broker_transport_options['global_keyprefix']}"
                                f"{REPLAY_QUEUE}"))
    if left or published != replay_count:
        raise RuntimeError(f"bulk replay left {left} letters and published {published}")
    timed.append(Timed(f"`dlq replay --all` of {replay_count:,} READ_ONLY letters", None,
                       seconds, rss, f"{replay_count / seconds:,.0f} replays/s"))
    progress(f"bulk replay of {replay_count:,}: {seconds:.1f} s, {rss:.1f} MiB")

    purged_queue = QUEUES[-1]
    purge_count = letters.stats().by_queue.get(purged_queue, 0)
    seconds, rss = cli(environment, "dlq", "purge", "--all", "--older-than", "0s", "--queue",
                       purged_queue, "--yes", repeat=1)
    left = letters.stats().by_queue.get(purged_queue, 0)
    if left or not purge_count:
        raise RuntimeError(f"bulk purge of {purge_count} letters left {left}")
    timed.append(Timed(f"`dlq purge --all` of {purge_count:,} letters (one queue)", None,
                       seconds, rss, f"{purge_count / seconds:,.0f} purges/s"))
    progress(f"bulk purge of {purge_count:,}: {seconds:.1f} s, {rss:.1f} MiB")
    return timed


def audit_read(app: Celery, environment: dict[str, str], *, global_events: int,
               run_events: int, progress: Callable[[str], None]) -> list[Timed]:
    """``events(run_id)`` of a run with ``run_events`` events beside a global stream of
    ``global_events``."""
    audit = AuditLog(app)
    client = audit.client
    started = time.perf_counter()
    context = StepContext(run_id="", task_id="", tool="agent.search_catalog",
                          effect=ToolEffect.READ_ONLY, queue="tools", redelivered=False,
                          worker=worker_identity())
    pipe: Any = client.pipeline(transaction=False)  # redis-py's pipeline is not annotated
    for number in range(global_events - run_events):
        run = f"other-run-{number // 10}"
        event = replace(context.event("outcome", "succeeded", attempt=1, duration_ms=1.5,
                                      payload={"args_size": "24", "result_size": "120"}),
                        run_id=run, task_id=f"task-{number}")
        pipe.execute_command(*audit.global_copy(flatten(event)))
        if number % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    run_id = f"bench-run-{uuid.uuid4().hex[:8]}"
    for number in range(run_events):
        event = replace(context.event("outcome", "succeeded", attempt=1, duration_ms=1.5,
                                      payload={"args_size": "24", "result_size": "120"}),
                        run_id=run_id, task_id=f"{run_id}-{number}")
        if not audit.record_step(event):
            raise RuntimeError("an audit event was not stored")
    length = int(client.xlen(audit.keys.global_events))
    progress(f"audit: {length:,} events in the global stream, written in "
             f"{time.perf_counter() - started:.1f}s")
    if length < global_events * 0.99:
        raise RuntimeError(f"the global stream holds {length}, not {global_events}")
    if len(audit.events(run_id)) != run_events:
        raise RuntimeError(f"the run does not hold {run_events} events")
    seconds, rss = cli(environment, "audit", "show", run_id)
    timed = [
        Timed(f"`audit show RUN_ID` ({run_events:,} events; global stream "
              f"{length:,})", in_process(lambda: audit.events(run_id)), seconds, rss),
        Timed("`audit tail -n 100`", in_process(lambda: audit.tail(100)),
              *cli(environment, "audit", "tail", "-n", "100")),
    ]
    for entry in timed:
        progress(f"{entry.operation}: {entry.in_process_ms:.2f} ms in process, "
                 f"{entry.process_seconds:.2f} s as a process")
    return timed
