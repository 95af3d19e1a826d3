"""The crash test: real workers, real SIGKILLs, and the at-most-once promise.

Two ``celery worker`` processes (prefork) consume a mix of READ_ONLY,
IDEMPOTENT_WRITE and NON_IDEMPOTENT_WRITE tool calls (``--tools`` restricts
the mix) whose bodies take random time and count their executions in Redis, on
a Redis broker with a short visibility timeout, or on RabbitMQ (``--broker
amqp://...``: give it a virtual host of its own) with a short journal heartbeat
(0.5 s). Every task is submitted at the start; meanwhile whole workers and
single pool children are killed with SIGKILL at random moments and workers are
restarted. At the end:

- every submitted task is in exactly one final place (succeeded, or a dead letter);
- no NON_IDEMPOTENT_WRITE body started twice;
- every interrupted NON_IDEMPOTENT_WRITE is a dead letter with reason
  interrupted_write, except those of ``tools.charge``, which declares
  ``reconcile`` (it asks a provider stand-in that deduplicates by idempotency
  key): its body never starts again once the charge was made, it charges at
  most once, and how many interruptions reconciliation settled is counted;
- every write that ran has its intent event;
- no message was lost.

**The fetch** (Redis broker, ``--fetch``). kombu's own Redis fetch takes a
message off the queue with ``BRPOP`` and only then records it as
unacknowledged (``QoS.append``, a second command): a worker killed between the
two loses the message before Celery or this package sees it. The package's
atomic fetch (``celery_tooleffect.worker.transport``, ``store/scripts/fetch.lua``;
on by default, ``--fetch atomic``) records the message in kombu's ``unacked``
hash and index and pops it in one Lua script, which closes that window: a
killed worker's message is either still queued or unacknowledged, and kombu's
restore brings it back. With it there is no excused loss: every task that is
not final is a problem, printed with where it stands.

With kombu's own fetch (``--fetch kombu``, ``tooleffect_atomic_fetch=False``
in the workers and the producer) the window is open, and such a loss is
counted apart (``lost_in_transport``), only with all the evidence of that
window: no worker's log names the task (Celery logs every task it receives),
it has no audit event and no journal entry, and its message is neither queued
nor unacknowledged. Any other task that is not final is a problem. RabbitMQ
has no such window (``fetch=amqp`` in the summary).

It prints one summary line: the fetch, the kills, the executions per effect,
the duplicates, ``lost`` broken down per tool, the dead letters by reason, how
many interruptions reconciliation settled, the problems, how many messages
were still queued when the last kill was made (above zero: tasks kept coming
for the whole kill period) and how many kills found messages queued, and the
duration; then every problem with its evidence (where the task stands, the
worker log lines naming it and when those logs end). The run's folder, printed
first, keeps every worker's log and the kill log (``kills.txt``: when each
kill was made, and of what). Short form (run by the test suite)::

    python -m chaos.crash_test --kills 10 --tasks 60

After the last kill the tasks have ``--settle-timeout`` seconds to become
final; on a Redis broker the wait ends sooner once, for a minute, no message
of the run was queued or unacknowledged and no task became final (nothing can
move any more). Long form, by hand (a longer ``--settle-timeout``: the backlog
left when the kills end is drained by four pool processes, two or three tasks a
second)::

    python -m chaos.crash_test --kills 1000 --tasks 4500 --settle-timeout 1800
    python -m chaos.crash_test --kills 1000 --tasks 4500 --settle-timeout 1800 --fetch kombu
    python -m chaos.crash_test --kills 500 --tasks 2250 --settle-timeout 1800 \\
        --tools tools.write_deadline
    python -m chaos.crash_test --kills 200 --tasks 600 --broker amqp://guest:guest@127.0.0.1:5672/crash
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import redis
from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters
from celery_tooleffect.store.journal import Journal, JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import WorkerProcess, delete_keys, start_celery_worker
from tests.support import REDIS_URL, TEST_FETCH, app_config

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
#: The fetches of a Redis broker (``--fetch``): the package's atomic fetch, or
#: kombu's own (``BRPOP``, then ``QoS.append``).
FETCHES = ("atomic", "kombu")
#: Seconds with no message of the run queued or unacknowledged on a Redis
#: broker, and no task becoming final, after which the wait for the tasks to
#: settle ends before its timeout (every message a worker holds, running,
#: prefetched or waiting for a retry's countdown, is in ``unacked``).
IDLE_SETTLED = 60.0
#: The kill log in the run's log folder: when each kill was made, and of what
#: (a lost task's evidence is read against it and the workers' logs).
KILL_LOG = "kills.txt"
#: At most this many worker log lines naming a task go into its evidence.
LOG_LINES = 12
#: The time stamp a worker's log line starts with.
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d [\d:,]+):", re.MULTILINE)


@dataclass
class Summary:
    tasks: int = 0
    kills: int = 0
    child_kills: int = 0
    #: ``atomic`` or ``kombu`` on a Redis broker, ``amqp`` on RabbitMQ.
    fetch: str = "atomic"
    executions: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    #: Tasks not final when the settle timeout ended.
    lost: int = 0
    #: ``lost`` per tool.
    lost_by_tool: Counter[str] = field(default_factory=Counter)
    #: Of ``lost``, with kombu's fetch only: taken off the queue by a worker
    #: killed before it recorded the message as unacknowledged (kombu's window;
    #: see the module docs). Always 0 with the atomic fetch and on RabbitMQ.
    lost_in_transport: int = 0
    dead_letters: Counter[str] = field(default_factory=Counter)
    #: Interrupted writes of the reconciling tool that its reconcile settled.
    reconciled: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    #: What is known of each ``lost_in_transport`` task.
    transport_losses: list[str] = field(default_factory=list)
    #: Messages still queued on the Redis broker when the last kill was made
    #: (None on RabbitMQ): above zero, tasks kept coming the whole kill period.
    queued_at_last_kill: int | None = None
    #: Kills made while messages were still queued (None on RabbitMQ).
    kills_while_queued: int | None = None
    #: Seconds from the first worker's start to the last check.
    seconds: float = 0.0

    def line(self) -> str:
        execs = " ".join(f"{effect}={n}" for effect, n in sorted(self.executions.items()))
        letters = " ".join(f"{reason}={n}" for reason, n in sorted(self.dead_letters.items()))
        reconciled = " ".join(f"{status}={n}" for status, n in sorted(self.reconciled.items()))
        lost = " ".join(f"{tool}={n}" for tool, n in sorted(self.lost_by_tool.items()))
        transport = (f" (in_transport={self.lost_in_transport})" if self.fetch == "kombu"
                     else "")
        queued = ("-" if self.queued_at_last_kill is None else
                  f"{self.queued_at_last_kill} (kills while queued={self.kills_while_queued})")
        return (
            f"crash test: fetch={self.fetch} tasks={self.tasks} kills={self.kills} "
            f"(whole workers={self.kills - self.child_kills}, pool children={self.child_kills}) "
            f"executions[{execs}] duplicate_non_idempotent={self.duplicates} "
            f"lost={self.lost}[{lost}]{transport} "
            f"dead_letters={sum(self.dead_letters.values())}[{letters}] "
            f"reconciled={sum(self.reconciled.values())}[{reconciled}] "
            f"problems={len(self.problems)} queued_at_last_kill={queued} "
            f"duration={self.seconds:.0f}s"
        )


#: The journal heartbeat on RabbitMQ (no visibility timeout there): a dead
#: owner's lease lapses within three of these.
RABBITMQ_HEARTBEAT = 0.5


def spawn(prefix: str, logdir: Path, index: int, visibility_timeout: float,
          broker_url: str = REDIS_URL, fetch: str = TEST_FETCH,
          store_url: str | None = None) -> WorkerProcess:
    """A ``celery worker`` of the test suite's tool app (``tests/apps/tool_app.py``,
    run as a module from the repository's root, never imported here), with
    ``fetch`` on a Redis broker (``TOOLEFFECT_TEST_FETCH``, read by
    ``tests.support.app_config``); ``store_url``: results and store there
    (another database of the broker's server: Celery's split deployment)."""
    env = dict(TE_PREFIX=prefix, TE_BROKER=broker_url, TE_COUNTERS=REDIS_URL,
               TE_VT=str(visibility_timeout), TE_MAX_RETRIES="5",
               TOOLEFFECT_TEST_FETCH=fetch)
    if store_url:
        env.update(TE_STORE=store_url, TE_RESULTS=store_url)
    if not broker_url.startswith("redis"):
        env["TE_HEARTBEAT"] = str(RABBITMQ_HEARTBEAT)
    return start_celery_worker(
        TOOL_APP, logdir / f"worker-{index}.log", concurrency=2, name=f"crash{index}",
        env=env, root=ROOT, ready_timeout=60,
    )


def run(kills: int, tasks: int, seed: int, visibility_timeout: float = 3.0,
        settle_timeout: float = 240.0, broker_url: str = REDIS_URL,
        fetch: str | None = None, tools: Sequence[str] | None = None,
        store_url: str | None = None) -> Summary:
    """The crash test (see the module docs). ``fetch``: ``atomic`` or ``kombu``
    on a Redis broker (default: the test suite's, ``TOOLEFFECT_TEST_FETCH``);
    ``tools``: the tools of the mix (default: all of :data:`TOOLS`), chosen
    evenly; ``settle_timeout``: how long, after the last kill, the tasks have to
    become final; ``store_url``: Celery's results and the package's store there,
    not on the broker (Celery's split deployment: another database of the
    broker's server)."""
    fetch = fetch or TEST_FETCH
    if fetch not in FETCHES:
        raise ValueError(f"fetch must be one of {FETCHES}, not {fetch!r}")
    names = list(tools or TOOLS)
    unknown = [name for name in names if name not in TOOLS]
    if unknown or not names:
        raise ValueError(f"unknown tools {unknown}: choose among {sorted(TOOLS)}")
    on_redis = broker_url.startswith("redis")
    started = time.monotonic()
    rng = random.Random(seed)
    prefix = f"crash:{uuid.uuid4().hex[:10]}:"
    client = redis.Redis.from_url(REDIS_URL)
    app = Celery("crash-producer", set_as_current=False)
    app.conf.update(app_config(
        prefix, broker_url=broker_url, tooleffect_atomic_fetch=fetch == "atomic",
        broker_transport_options={"global_keyprefix": prefix,
                                  "visibility_timeout": visibility_timeout}))
    if store_url:
        app.conf.update(result_backend=store_url, tooleffect_redis_url=store_url)
    if not on_redis:
        app.conf.broker_transport_options = {}
        app.conf.tooleffect_heartbeat_interval = RABBITMQ_HEARTBEAT
        # The store is the workers' (TE_COUNTERS): never the package's default.
        app.conf.tooleffect_redis_url = REDIS_URL
    logdir = Path(tempfile.mkdtemp(prefix="tooleffect-crash-"))
    print(f"worker logs and kill log: {logdir}", file=sys.stderr)
    summary = Summary(tasks=tasks, fetch=fetch if on_redis else "amqp")
    workers = [spawn(prefix, logdir, i, visibility_timeout, broker_url, fetch, store_url)
               for i in range(2)]
    spawned = 2
    submitted: dict[str, tuple[str, str]] = {}  # task id -> (tool, key)
    kill_log = (logdir / KILL_LOG).open("a")

    def note(text: str) -> None:
        """One line of the kill log: the wall clock time (as the workers' logs
        give it) and what was done."""
        kill_log.write(f"{datetime.now():%Y-%m-%d %H:%M:%S,%f}"[:-3] + f" {text}\n")
        kill_log.flush()

    try:
        for _ in range(tasks):
            name = rng.choice(names)
            key = uuid.uuid4().hex[:10]
            hold = rng.uniform(0.05, 2.5)
            args: list[object] = [key, hold]
            if name == RECONCILING:
                args.append(rng.choice(["after", "before"]))
            result = app.send_task(name, args=args, queue="tools")
            submitted[result.id] = (name, key)

        if on_redis:
            summary.kills_while_queued = 0
        for _ in range(kills):
            time.sleep(rng.uniform(0.2, 1.2))
            if summary.kills_while_queued is not None and queued(client, prefix):
                summary.kills_while_queued += 1
            index = rng.randrange(len(workers))
            worker = workers[index]
            children = worker.children()
            if children and rng.random() < 0.6:
                child = rng.choice(children)
                note(f"kill {summary.kills + 1}: pool child {child} of {worker.log.name}")
                os.kill(child, signal.SIGKILL)
                summary.child_kills += 1
            else:
                note(f"kill {summary.kills + 1}: whole worker {worker.log.name} "
                     f"(pid {worker.process.pid})")
                worker.kill()
                workers[index] = spawn(prefix, logdir, spawned, visibility_timeout,
                                       broker_url, fetch, store_url)
                note(f"started {workers[index].log.name}")
                spawned += 1
            summary.kills += 1
        if on_redis:
            summary.queued_at_last_kill = queued(client, prefix)

        dead_letters = DeadLetters(app)

        def final(task_id: str) -> bool:
            return (app.AsyncResult(task_id).state == "SUCCESS"
                    or dead_letters.get(task_id) is not None)

        deadline = time.monotonic() + settle_timeout
        pending = set(submitted)
        idle_since: float | None = None
        while pending and time.monotonic() < deadline:
            left = len(pending)
            pending = {task_id for task_id in pending if not final(task_id)}
            if not pending:
                break
            if on_redis:
                # Nothing queued nor unacknowledged, and no task final since:
                # no worker holds a message of the run, nothing can move any more.
                now = time.monotonic()
                if len(pending) < left or queued(client, prefix) or client.hlen(
                        f"{prefix}unacked"):
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= IDLE_SETTLED:
                    break
            time.sleep(0.5)
        summary.lost = len(pending)
        logs = {path.name: path.read_text(errors="replace")
                for path in sorted(logdir.glob("*.log"))}
        if on_redis:
            summary.problems.extend(wrong_fetch(logs, fetch))
        for task_id in sorted(pending, key=lambda task_id: submitted[task_id]):
            name = submitted[task_id][0]
            summary.lost_by_tool[name] += 1
            place = where_is(app, client, prefix, task_id)
            named = log_lines(logs, task_id)
            if fetch == "kombu" and on_redis and never_received(place, named):
                summary.lost_in_transport += 1
                summary.transport_losses.append(f"{submitted[task_id]} {task_id}: {place}, "
                                                "named in no worker's log")
            else:
                evidence = ("; ".join(named) if named else "named in no worker's log")
                summary.problems.append(
                    f"not final: {submitted[task_id]} {task_id}: {place}; logs: {evidence}")
        check(app, client, prefix, submitted, summary)
    finally:
        for worker in workers:
            worker.kill()
        delete_keys(client, prefix)
        kill_log.close()
        summary.seconds = time.monotonic() - started
    return summary


def queued(client: redis.Redis, prefix: str) -> int:
    """How many messages wait in the ``tools`` queue (every list of kombu's
    default priority steps: ``tools``, ``tools\\x06\\x163`` ...)."""
    keys = [f"{prefix}tools", *(f"{prefix}tools\x06\x16{step}" for step in (3, 6, 9))]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
    return sum(int(length) for length in pipe.execute())


def where_is(app: Celery, client: redis.Redis, prefix: str, task_id: str) -> str:
    """Where a task that is not final stands: its audit trail, its journal, and
    whether its message is queued or held unacknowledged on a Redis broker."""
    audit = AuditLog(app)
    trail = " ".join(f"{e['phase']}:{e['status']}" for e in audit.events(task_id))
    runtime = runtime_for(app)
    journal = Journal(runtime.settings, audit).read(JournalRef(task_id, task_id))
    needle = task_id.encode()
    in_queue = sum(needle in item for key in client.scan_iter(f"{prefix}tools*")
                   if client.type(key) == b"list" for item in client.lrange(key, 0, -1))
    unacked = sum(needle in value for value in client.hvals(f"{prefix}unacked"))
    return (f"audit[{trail}] journal[state={journal.get('state')} "
            f"attempt={journal.get('attempt')}] queued={in_queue} unacked={unacked}")


def wrong_fetch(logs: dict[str, str], fetch: str) -> list[str]:
    """The workers whose start-up banner names another fetch than ``fetch``
    (the atomic fetch's transport line ends with ``(atomic fetch)``)."""
    wrong = []
    for name, text in logs.items():
        for line in text.splitlines():
            if ".> transport:" in line and ("(atomic fetch)" in line) != (fetch == "atomic"):
                wrong.append(f"{name} ran another fetch than {fetch}: {line.strip()}")
    return wrong


def log_lines(logs: dict[str, str], task_id: str) -> list[str]:
    """The worker log lines that name ``task_id`` (at most :data:`LOG_LINES`),
    each with its log's name, and when each of those logs ends (a log that
    ends at once after the task was received is a worker killed whole then;
    see the kill log, :data:`KILL_LOG`)."""
    found: list[str] = []
    for name, text in logs.items():
        lines = [line.strip()[:300] for line in text.splitlines() if task_id in line]
        if lines:
            found.extend(f"{name}: {line}" for line in lines)
            stamps = STAMP.findall(text)
            found.append(f"{name} ends {stamps[-1] if stamps else '?'}")
    if len(found) > LOG_LINES:
        found = [*found[:LOG_LINES], f"... {len(found) - LOG_LINES} more"]
    return found


def never_received(place: str, named: Sequence[str]) -> bool:
    """Whether a task that is not final shows every mark of kombu's window: no
    trace in the store, its message nowhere on the broker (``where_is``
    describes both), and no worker's log naming it (``named``: the lines that
    do)."""
    untouched = "audit[] journal[state=None attempt=None] queued=0 unacked=0"
    return place == untouched and not named


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


def split_url(broker_url: str) -> str:
    """The URL of database 1 of a Redis broker's server (0 if the broker is in 1)."""
    base, _, db = broker_url.rpartition("/")
    if not base.startswith("redis") or not db.isdigit():
        raise SystemExit(f"--split needs a redis://host:port/db broker URL, not {broker_url}")
    return f"{base}/{0 if db == '1' else 1}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=60)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--visibility-timeout", type=float, default=3.0)
    parser.add_argument("--settle-timeout", type=float, default=240.0,
                        help="seconds the tasks have, after the last kill, to become final")
    parser.add_argument("--broker", default=REDIS_URL,
                        help="broker URL: redis://... (default) or amqp://... (RabbitMQ)")
    parser.add_argument("--fetch", choices=FETCHES, default=TEST_FETCH,
                        help="on a Redis broker: the package's atomic fetch (default) or "
                             "kombu's own")
    parser.add_argument("--split", action="store_true",
                        help="Celery's split deployment: results and store in database 1 of "
                             "the broker's Redis server (the broker in its own database)")
    parser.add_argument("--tools", type=lambda value: [name.strip() for name in
                                                       value.split(",") if name.strip()],
                        default=None, metavar="NAME[,NAME]",
                        help=f"the tools of the mix (default all: {','.join(TOOLS)})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.tools or () if name not in TOOLS]
    if unknown or args.tools == []:
        parser.error(f"--tools: unknown {unknown}; choose among {','.join(TOOLS)}")
    summary = run(args.kills, args.tasks, args.seed, args.visibility_timeout,
                  settle_timeout=args.settle_timeout, broker_url=args.broker,
                  fetch=args.fetch, tools=args.tools,
                  store_url=split_url(args.broker) if args.split else None)
    print(summary.line() + f" broker={args.broker.split('@')[-1]} seed={args.seed}")
    for problem in summary.problems:
        print("  " + problem)
    for loss in summary.transport_losses:
        print("  lost in kombu's BRPOP window: " + loss)
    return 1 if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
