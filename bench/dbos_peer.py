# mypy: disallow-untyped-decorators=False
# (dbos is an optional extra: without it installed, its decorators are untyped.)
"""The peer row: the benchmark's trivial tool as a durable step in DBOS Transact.

DBOS Transact (``dbos`` on PyPI) keeps every workflow and step in PostgreSQL.
The same body as ``bench.app.work`` runs as a ``@DBOS.step`` inside a
``@DBOS.workflow``, enqueued on a DBOS queue (a queue, as Celery is one),
executed by this process with ``worker_concurrency`` 2 (the Celery variants
run on one worker with two pool processes) and a queue polling interval of
10 ms (DBOS's default is 1 s, which would measure the poll, not the work).

Run by ``python -m bench`` as its own process, so DBOS's threads share
nothing with the benchmark's; prints one JSON object on its last line::

    python -m bench.dbos_peer postgresql://postgres@127.0.0.1:5432/tooleffect_bench_dbos

Throughput: a round enqueues ``--calls`` workflows, each delayed until all
are enqueued (DBOS's ``delay_seconds``: the Celery rows likewise publish
before consuming), and waits for every result; its rate is ``(N - 1) / (last
completion - first completion)``, from the ``updated_at`` DBOS stored with
each final status (as the Celery rows use the worker's ``date_done``).
Latency: one call at a time, from just before its enqueue to its stored
completion. The system database is reset first and dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata
from typing import Any

#: How often a handle asks PostgreSQL for its result (DBOS's default is 1 s;
#: the figures come from stored timestamps, this only sets how long a run takes).
POLL = 0.005
#: Seconds the body waits (``--body-ms``), as ``bench.app.work`` does.
BODY_SECONDS = 0.0


def work(n: int) -> int:
    """The body every variant shares (``bench.app.work``)."""
    if BODY_SECONDS:
        time.sleep(BODY_SECONDS)
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("database_url")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--latency-calls", type=int, default=400)
    parser.add_argument("--body-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    global BODY_SECONDS
    BODY_SECONDS = args.body_ms / 1000.0

    from dbos import DBOS, DBOSConfig, SetEnqueueOptions

    config: DBOSConfig = {"name": "tooleffect-bench", "system_database_url": args.database_url,
                          "log_level": "WARNING"}
    DBOS(config=config)

    @DBOS.step()
    def tool_step(n: int) -> int:
        return work(n)

    @DBOS.workflow()
    def tool_call(n: int) -> int:
        return int(tool_step(n))

    DBOS.reset_system_database()
    DBOS.launch()
    queue = DBOS.register_queue("bench", polling_interval_sec=0.01)
    try:
        def completed_ms(ids: list[str]) -> list[int]:
            statuses = DBOS.list_workflows(workflow_ids=ids, load_input=False,
                                           load_output=False)
            if len(statuses) != len(ids) or any(s.status != "SUCCESS" for s in statuses):
                raise RuntimeError("a DBOS workflow did not end in SUCCESS")
            return sorted(int(s.updated_at or 0) for s in statuses)

        enqueue_seconds = 0.005  # per call; measured by the warm-up round

        def one_round(calls: int) -> float:
            nonlocal enqueue_seconds
            # Every workflow is held (DELAYED) until all are enqueued, so that
            # the rate is the queue draining, as in the Celery rows.
            started = time.time()
            release_at = started + calls * enqueue_seconds * 1.5 + 0.5
            handles = []
            for i in range(calls):
                with SetEnqueueOptions(delay_seconds=max(release_at - time.time(), 0.0)):
                    handles.append(queue.enqueue(tool_call, i))
            enqueue_seconds = (time.time() - started) / calls
            results = [handle.get_result(polling_interval_sec=POLL) for handle in handles]
            if results != list(range(calls)):
                raise RuntimeError("a DBOS workflow returned something else")
            done = completed_ms([handle.workflow_id for handle in handles])
            if done[0] < release_at * 1000.0 - 50:
                raise RuntimeError("a DBOS workflow ran before its release")
            overlapped.append(time.time() - started > 0 and enqueue_seconds * calls
                              > release_at - started)
            return (calls - 1) / max((done[-1] - done[0]) / 1000.0, 1e-6)

        overlapped: list[bool] = []
        one_round(args.warmup)
        rounds = [one_round(args.calls) for _ in range(args.rounds)]
        latencies: list[float] = []
        for i in range(args.latency_calls + 5):
            started = time.time()
            handle = queue.enqueue(tool_call, i)
            handle.get_result(polling_interval_sec=POLL)
            if i >= 5:  # the first after the switch, as the Celery rows discard theirs
                latencies.append(completed_ms([handle.workflow_id])[0] - started * 1000.0)
        figures: dict[str, Any] = {"version": metadata.version("dbos"), "calls": args.calls,
                                   "rounds": rounds, "latencies_ms": latencies,
                                   "rounds_overlapping_enqueue": sum(overlapped[1:])}
    finally:
        DBOS.destroy()
    drop_database(args.database_url)
    print(json.dumps(figures))
    return 0


def drop_database(url: str) -> None:
    """Drop the run's system database (the run created it)."""
    import sqlalchemy

    engine_url = sqlalchemy.make_url(url)
    server = sqlalchemy.create_engine(engine_url.set(database="postgres"),
                                      isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as connection:
            connection.execute(sqlalchemy.text(
                f'DROP DATABASE IF EXISTS "{engine_url.database}" WITH (FORCE)'))
    finally:
        server.dispose()


if __name__ == "__main__":
    sys.exit(main())
