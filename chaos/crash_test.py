"""The crash test: real workers, real SIGKILLs, and the at-most-once promise.

Two ``celery worker`` processes (prefork) consume a mix of READ_ONLY,
IDEMPOTENT_WRITE and NON_IDEMPOTENT_WRITE tool calls whose bodies take random
time and count their executions in Redis, on a Redis broker with a short
visibility timeout, or on RabbitMQ (``--broker amqp://...``: give it a virtual
host of its own) with a short journal heartbeat (0.5 s). Meanwhile whole
workers and single pool children are killed with SIGKILL at random moments and
workers are restarted. At the end:

- every submitted task is in exactly one final place (succeeded, or a dead letter);
- no NON_IDEMPOTENT_WRITE body started twice;
- every interrupted NON_IDEMPOTENT_WRITE is a dead letter with reason
  interrupted_write, except those of ``tools.charge``, which declares
  ``reconcile`` (it asks a provider stand-in that deduplicates by idempotency
  key): its body never starts again once the charge was made, it charges at
  most once, and how many interruptions reconciliation settled is counted;
- every write that ran has its intent event;
- no message was lost.

One loss is not the package's and is counted apart (``lost_in_transport``):
kombu's Redis transport takes a message off the queue with ``BRPOP`` and only
then records it as unacknowledged (``QoS.append``, a second command), so a
worker killed between the two loses the message before Celery or this package
sees it. A task is counted there only with all the evidence of that window:
on a Redis broker, no worker's log names it (Celery logs every task it
receives), it has no audit event and no journal entry, and its message is
neither queued nor unacknowledged. Any other task that is not final is a
problem. RabbitMQ has no such window.

It prints one summary line. Short form (run by the test suite)::

    python -m chaos.crash_test --kills 10 --tasks 60

Long form, by hand::

    python -m chaos.crash_test --kills 200 --tasks 600
    python -m chaos.crash_test --kills 200 --tasks 600 --broker amqp://guest:guest@127.0.0.1:5672/crash
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis
from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters
from celery_tooleffect.store.journal import Journal, JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import (
    REDIS_URL,
    WorkerProcess,
    app_config,
    delete_keys,
    start_celery_worker,
)

ROOT = Path(__file__).resolve().parent.parent
#: The worker's app: the test suite's tools (they count their runs in Redis).
TOOL_APP = "tests.apps.tool_app"
TOOLS = {
    "tools.read": "read_only",
    "tools.idempotent": "idempotent_write",
    "tools.write": "non_idempotent_write",
    "tools.write_deadline": "non_idempotent_write",
    "tools.charge": "non_idempotent_write",
}
#: The tool that reconciles (its args: key, hold, when it charges).
RECONCILING = "tools.charge"


@dataclass
class Summary:
    tasks: int = 0
    kills: int = 0
    child_kills: int = 0
    executions: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    lost: int = 0
    #: Of ``lost``: taken off the queue by a worker killed before it recorded
    #: the message as unacknowledged (kombu's window; see the module docs).
    lost_in_transport: int = 0
    dead_letters: Counter[str] = field(default_factory=Counter)
    #: Interrupted writes of the reconciling tool that its reconcile settled.
    reconciled: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    #: What is known of each ``lost_in_transport`` task.
    transport_losses: list[str] = field(default_factory=list)

    def line(self) -> str:
        execs = " ".join(f"{effect}={n}" for effect, n in sorted(self.executions.items()))
        letters = " ".join(f"{reason}={n}" for reason, n in sorted(self.dead_letters.items()))
        reconciled = " ".join(f"{status}={n}" for status, n in sorted(self.reconciled.items()))
        return (
            f"crash test: tasks={self.tasks} kills={self.kills} "
            f"(whole workers={self.kills - self.child_kills}, pool children={self.child_kills}) "
            f"executions[{execs}] duplicate_non_idempotent={self.duplicates} "
            f"lost={self.lost} (in_transport={self.lost_in_transport}) "
            f"dead_letters={sum(self.dead_letters.values())}[{letters}] "
            f"reconciled={sum(self.reconciled.values())}[{reconciled}] "
            f"problems={len(self.problems)}"
        )


#: The journal heartbeat on RabbitMQ (no visibility timeout there): a dead
#: owner's lease lapses within three of these.
RABBITMQ_HEARTBEAT = 0.5


def spawn(prefix: str, logdir: Path, index: int, visibility_timeout: float,
          broker_url: str = REDIS_URL) -> WorkerProcess:
    """A ``celery worker`` of the test suite's tool app (``tests/apps/tool_app.py``,
    run as a module from the repository's root, never imported here)."""
    env = dict(TE_PREFIX=prefix, TE_BROKER=broker_url, TE_COUNTERS=REDIS_URL,
               TE_VT=str(visibility_timeout), TE_MAX_RETRIES="5")
    if not broker_url.startswith("redis"):
        env["TE_HEARTBEAT"] = str(RABBITMQ_HEARTBEAT)
    return start_celery_worker(
        TOOL_APP, logdir / f"worker-{index}.log", concurrency=2, name=f"crash{index}",
        env=env, root=ROOT, ready_timeout=60,
    )


def run(kills: int, tasks: int, seed: int, visibility_timeout: float = 3.0,
        settle_timeout: float = 240.0, broker_url: str = REDIS_URL) -> Summary:
    rng = random.Random(seed)
    prefix = f"crash:{uuid.uuid4().hex[:10]}:"
    client = redis.Redis.from_url(REDIS_URL)
    app = Celery("crash-producer", set_as_current=False)
    app.conf.update(app_config(prefix, broker_url=broker_url, broker_transport_options={
        "global_keyprefix": prefix, "visibility_timeout": visibility_timeout}))
    if not broker_url.startswith("redis"):
        app.conf.broker_transport_options = {}
        app.conf.tooleffect_heartbeat_interval = RABBITMQ_HEARTBEAT
    logdir = Path(tempfile.mkdtemp(prefix="tooleffect-crash-"))
    summary = Summary(tasks=tasks)
    workers = [spawn(prefix, logdir, i, visibility_timeout, broker_url) for i in range(2)]
    spawned = 2
    submitted: dict[str, tuple[str, str]] = {}  # task id -> (tool, key)
    try:
        names = list(TOOLS)
        for _ in range(tasks):
            name = rng.choice(names)
            key = uuid.uuid4().hex[:10]
            hold = rng.uniform(0.05, 2.5)
            args: list[object] = [key, hold]
            if name == RECONCILING:
                args.append(rng.choice(["after", "before"]))
            result = app.send_task(name, args=args, queue="tools")
            submitted[result.id] = (name, key)

        for _ in range(kills):
            time.sleep(rng.uniform(0.2, 1.2))
            index = rng.randrange(len(workers))
            worker = workers[index]
            children = worker.children()
            if children and rng.random() < 0.6:
                os.kill(rng.choice(children), signal.SIGKILL)
                summary.child_kills += 1
            else:
                worker.kill()
                workers[index] = spawn(prefix, logdir, spawned, visibility_timeout, broker_url)
                spawned += 1
            summary.kills += 1

        dead_letters = DeadLetters(app)

        def final(task_id: str) -> bool:
            return (app.AsyncResult(task_id).state == "SUCCESS"
                    or dead_letters.get(task_id) is not None)

        deadline = time.monotonic() + settle_timeout
        pending = set(submitted)
        while pending and time.monotonic() < deadline:
            pending = {task_id for task_id in pending if not final(task_id)}
            if pending:
                time.sleep(0.5)
        summary.lost = len(pending)
        logs = "\n".join(path.read_text(errors="replace") for path in logdir.glob("*.log"))
        for task_id in pending:
            place = where_is(app, client, prefix, task_id)
            if broker_url.startswith("redis") and never_received(place, task_id, logs):
                summary.lost_in_transport += 1
                summary.transport_losses.append(f"{submitted[task_id]} {task_id}: {place}, "
                                                "named in no worker's log")
            else:
                summary.problems.append(f"not final: {submitted[task_id]} {task_id}: {place}")
        check(app, client, prefix, submitted, summary)
    finally:
        for worker in workers:
            worker.kill()
        delete_keys(client, prefix)
    if summary.problems:
        print(f"worker logs: {logdir}", file=sys.stderr)
    return summary


def where_is(app: Celery, client: redis.Redis, prefix: str, task_id: str) -> str:
    """Where a task that is not final stands: its audit trail, its journal, and
    whether its message is queued or held unacknowledged on a Redis broker."""
    audit = AuditLog(app)
    trail = " ".join(f"{e['phase']}:{e['status']}" for e in audit.events(task_id))
    runtime = runtime_for(app)
    journal = Journal(runtime.settings, audit).read(JournalRef(task_id, task_id))
    needle = task_id.encode()
    queued = sum(needle in item for key in client.scan_iter(f"{prefix}tools*")
                 if client.type(key) == b"list" for item in client.lrange(key, 0, -1))
    unacked = sum(needle in value for value in client.hvals(f"{prefix}unacked"))
    return (f"audit[{trail}] journal[state={journal.get('state')} "
            f"attempt={journal.get('attempt')}] queued={queued} unacked={unacked}")


def never_received(place: str, task_id: str, logs: str) -> bool:
    """Whether a task that is not final shows every mark of kombu's window: no
    trace in the store, its message nowhere on the broker, and no worker's log
    naming it (``where_is`` describes the first two)."""
    untouched = "audit[] journal[state=None attempt=None] queued=0 unacked=0"
    return place == untouched and task_id not in logs


def check(app: Celery, client: redis.Redis, prefix: str,
          submitted: dict[str, tuple[str, str]], summary: Summary) -> None:
    audit = AuditLog(app)
    dead_letters = DeadLetters(app)
    for task_id, (name, key) in submitted.items():
        effect = TOOLS[name]
        runs = int(client.get(f"{prefix}count:{key}") or 0)
        summary.executions[effect] += runs
        letter = dead_letters.get(task_id)
        succeeded = app.AsyncResult(task_id).state == "SUCCESS"
        if letter is not None:
            summary.dead_letters[letter.reason] += 1
        if succeeded and letter is not None:
            summary.problems.append(f"both succeeded and dead-lettered: {name} {task_id}")
        events = audit.events(task_id)
        phases = [event["phase"] for event in events]
        if name == RECONCILING:
            check_reconciling(client, prefix, task_id, key, events, succeeded, summary)
        elif effect == "non_idempotent_write":
            if runs > 1:
                summary.duplicates += 1
                summary.problems.append(f"{name} {task_id} ran {runs} times")
            if "interrupted" in phases and (letter is None
                                            or letter.reason != "interrupted_write"):
                summary.problems.append(f"interrupted but not dead-lettered: {name} {task_id}")
        if effect != "read_only" and runs and phases.count("intent") < runs:
            summary.problems.append(
                f"{name} {task_id} ran {runs} times with {phases.count('intent')} intents"
            )


def check_reconciling(client: redis.Redis, prefix: str, task_id: str, key: str,
                      events: list[dict[str, str]], succeeded: bool, summary: Summary) -> None:
    """The reconciling tool: it may run again only when its charge was not made."""
    charges = int(client.get(f"{prefix}charges:{key}") or 0)
    after_charge = int(client.get(f"{prefix}after_charge:{key}") or 0)
    if after_charge:
        summary.duplicates += 1
        summary.problems.append(f"{RECONCILING} {task_id} ran again after its charge")
    if charges > 1 or (succeeded and charges != 1):
        summary.problems.append(f"{RECONCILING} {task_id}: {charges} charges, "
                                f"{'succeeded' if succeeded else 'not succeeded'}")
    for event in events:
        if event["phase"] == "reconcile":
            summary.reconciled[event["status"]] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=60)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--visibility-timeout", type=float, default=3.0)
    parser.add_argument("--broker", default=REDIS_URL,
                        help="broker URL: redis://... (default) or amqp://... (RabbitMQ)")
    args = parser.parse_args(argv)
    summary = run(args.kills, args.tasks, args.seed, args.visibility_timeout,
                  broker_url=args.broker)
    print(summary.line() + f" broker={args.broker.split('@')[-1]} seed={args.seed}")
    for problem in summary.problems[:20]:
        print("  " + problem)
    for loss in summary.transport_losses:
        print("  lost in kombu's BRPOP window: " + loss)
    return 1 if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
