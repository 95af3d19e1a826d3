"""The failover test: Sentinel promotes a replica while writes run.

A primary, ``replicas`` replicas and three Sentinels (``tests/topologies.py``),
all real processes on free ports; the broker, the result backend and the
store behind the Sentinels (``sentinel://...;sentinel://...`` with
``master_name``; ``tooleffect_redis_url`` unset, so the store follows the
broker's master). One worker (prefork, two children) runs
NON_IDEMPOTENT_WRITE and IDEMPOTENT_WRITE tools that hold for a moment and
count their runs in files, outside Redis.

Each round publishes a batch (and waits until the replicas hold it), waits
until writes are in their bodies, SIGKILLs the master, waits for the
Sentinels to promote a replica, starts the killed server again (the Sentinels
make it a replica of the new master) and waits for the batch to end. The
worker reconnects by itself. At the end:

- no NON_IDEMPOTENT_WRITE body ran twice (``duplicate_non_idempotent``);
- every task ended: its journal entry succeeded or is a dead letter, or its
  dead letter is stored (``lost`` counts the others);
- every run's audit chain verifies.

With ``--store-replicas 0`` (no ``WAIT``) the same run measures what the
default of a store that is not behind Sentinel would risk there.

Short form (run by the test suite, tests/faults/test_failover.py)::

    python -m chaos.failover --failovers 2 --tasks 8

Long form, by hand::

    python -m chaos.failover --failovers 20 --tasks 12
    python -m chaos.failover --failovers 20 --tasks 12 --store-replicas 0
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery

from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.testing import WorkerProcess, start_celery_worker, wait_for
from chaos.crash_test import where_is
from tests.support import app_config
from tests.topologies import MASTER, SentinelSet, sentinel_set

ROOT = Path(__file__).resolve().parent.parent
#: The journal lease of a write without a deadline is the visibility timeout:
#: an interrupted write's message comes back, and is settled, after it.
VISIBILITY_TIMEOUT = 8.0
#: How long each body holds: long enough to be caught by the failover.
HOLD = 1.5


@dataclass
class Summary:
    failovers: int = 0
    tasks: int = 0
    runs: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    lost: int = 0
    endings: Counter[str] = field(default_factory=Counter)
    broken_chains: int = 0
    promotion_seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        runs = " ".join(f"{kind}={n}" for kind, n in sorted(self.runs.items()))
        endings = " ".join(f"{kind}={n}" for kind, n in sorted(self.endings.items()))
        slowest = max(self.promotion_seconds, default=0.0)
        return (f"failover test: failovers={self.failovers} tasks={self.tasks} runs[{runs}] "
                f"duplicate_non_idempotent={self.duplicates} lost={self.lost} "
                f"endings[{endings}] broken_chains={self.broken_chains} "
                f"slowest_promotion={slowest:.1f}s problems={len(self.problems)}")


def _config(group: SentinelSet, prefix: str) -> dict[str, Any]:
    sentinel = {"master_name": MASTER}
    return app_config(
        prefix, broker_url=group.urls, result_backend=group.urls,
        broker_transport_options={"global_keyprefix": prefix, **sentinel},
        result_backend_transport_options={"global_keyprefix": prefix, **sentinel})


def _spawn(group: SentinelSet, prefix: str, runs: Path, logdir: Path,
           settings: dict[str, Any]) -> WorkerProcess:
    env = {"TE_PREFIX": prefix, "TE_BROKER": group.urls, "TE_BACKEND": group.urls,
           "TE_RUNS": str(runs),
           "TE_TRANSPORT": json.dumps({"master_name": MASTER,
                                       "visibility_timeout": VISIBILITY_TIMEOUT}),
           "TE_BACKEND_TRANSPORT": json.dumps({"master_name": MASTER}),
           "TE_SETTINGS": json.dumps(settings)}
    return start_celery_worker("tests.apps.prod_app", logdir / "worker.log", concurrency=2,
                               name="failover", env=env, root=ROOT, ready_timeout=60)


def run(failovers: int, tasks: int, replicas: int = 2, store_replicas: int | None = None,
        settle_timeout: float = 120.0) -> Summary:
    """Run the scenario; ``store_replicas`` None keeps the package's default."""
    summary = Summary()
    prefix = f"failover:{uuid.uuid4().hex[:8]}:"
    settings = {} if store_replicas is None else {"tooleffect_store_replicas": store_replicas}
    with tempfile.TemporaryDirectory(prefix="te-failover-") as folder, \
            sentinel_set(replicas=replicas) as group:
        runs = Path(folder) / "runs"
        runs.mkdir()
        producer = Celery("failover-producer", set_as_current=False)
        producer.conf.update(_config(group, prefix))
        runtime = runtime_for(producer)
        worker = _spawn(group, prefix, runs, Path(folder), settings)
        effects: dict[str, str] = {}
        try:
            for round_number in range(failovers):
                batch = []
                for index in range(tasks):
                    kind = "write" if index % 2 == 0 else "idem"
                    key = f"{kind}-{round_number}-{index}"
                    producer.send_task(f"prod.{kind}", (key, HOLD), task_id=key)
                    effects[key] = kind
                    batch.append(key)
                group.wait_replicated()
                try:
                    wait_for(lambda batch=batch: any((runs / key).exists() for key in batch),
                             timeout=60, what="a write to be in its body")
                except AssertionError:
                    summary.problems.append(f"round {round_number}: no body started in 60 s "
                                            f"{_stacks(worker)}")
                    raise
                started = time.monotonic()
                old = group.master()
                group.fail_over()
                summary.promotion_seconds.append(time.monotonic() - started)
                summary.failovers += 1
                group.restart(old)
                wait_for(lambda: len(group.replicas()) == replicas and int(
                    group.client(group.master()).info("replication")["connected_slaves"]
                ) >= replicas, timeout=60, what="the killed server to rejoin as a replica")
                _wait_ended(runtime, batch, settle_timeout, summary)
        finally:
            worker.stop()
            summary.tasks = len(effects)
            _count(runtime, runs, effects, summary)
            for index, problem in enumerate(summary.problems):
                key = problem.split(":", 1)[0]
                if key in effects:  # where it stands, and what the worker said of it
                    place = where_is(producer, group.client(group.master()), prefix, key)
                    said = [line for line in worker.output().splitlines() if key in line]
                    summary.problems[index] = f"{problem} {place} log{said}"
            if worker.process.returncode not in (0, None, -15):
                summary.problems.append(f"worker exited {worker.process.returncode}")
            if summary.problems:
                kept = Path(tempfile.gettempdir()) / f"te-failover-{prefix.split(':')[1]}.log"
                kept.write_text(worker.output())
                summary.problems.append(f"worker log kept in {kept}")
    return summary


def _stacks(worker: WorkerProcess) -> str:
    """What the worker's processes are doing (py-spy dump), when py-spy is here."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "(no py-spy to show the worker's stacks)"
    dumps = []
    for pid in [worker.process.pid, *worker.children()]:
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=60, check=False)
        dumps.append(done.stdout + done.stderr)
    return "\n".join(dumps)


def _ending(runtime: Any, task_id: str) -> str | None:
    """How a task ended (journal state or dead letter reason); None if it has not."""
    try:
        entry = runtime.journal.read(JournalRef(task_id, task_id))
        letter = runtime.dead_letters.get(task_id)
    except Exception:  # the store is failing over: not yet known
        return None
    if letter is not None:
        return f"dead_letter:{letter.reason}"
    if entry.get("state") == "succeeded":
        return "succeeded"
    return None


def _wait_ended(runtime: Any, batch: list[str], timeout: float, summary: Summary) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_ending(runtime, key) for key in batch):
            return
        time.sleep(0.25)


def _count(runtime: Any, runs: Path, effects: dict[str, str], summary: Summary) -> None:
    for key, kind in sorted(effects.items()):
        count = (runs / key).read_text().count("\n") if (runs / key).exists() else 0
        summary.runs[kind] += count
        if kind == "write" and count > 1:
            summary.duplicates += 1
            summary.problems.append(f"{key}: non-idempotent body ran {count} times")
        ending = _ending(runtime, key)
        if ending is None:
            summary.lost += 1
            summary.problems.append(f"{key}: never ended (runs={count})")
        else:
            summary.endings[ending] += 1
        try:
            check = runtime.audit.verify(key)
        except Exception as exc:
            summary.problems.append(f"{key}: audit chain not readable: {exc}")
            continue
        if not check.intact:
            summary.broken_chains += 1
            summary.problems.append(f"{key}: audit chain broken at {check.broken_at}: "
                                    f"{check.problem}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failovers", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=12, help="tasks per failover")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--store-replicas", type=int, default=None,
                        help="tooleffect_store_replicas (default: the package's)")
    args = parser.parse_args(argv)
    summary = run(args.failovers, args.tasks, args.replicas, args.store_replicas)
    print(summary.line())
    for problem in summary.problems:
        print(" ", problem)
    return 1 if summary.duplicates or summary.lost or summary.broken_chains else 0


if __name__ == "__main__":
    sys.exit(main())
