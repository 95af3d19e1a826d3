"""What a write's two scripts cost the server, measured alone.

``INFO commandstats`` of a loaded worker mixes a write's scripts with the
fetch script, and a busy machine's other processes with all of them.
This program drives the package's own ``Journal.begin_attempt`` and
``Journal.transition`` (the intent, then the outcome with Celery's result
and the message's acknowledgement, as a worker on one Redis sends them: one
call per run) against a redis-server of its own with nothing else running,
one call at a time as a worker sends them (the same scripts sent thousands
to a pipeline cost the server about half as much each: that is not how a
worker calls them), and reads each script's ``usec_per_call``: once as
shipped, once with copies of the scripts whose ``append_event`` stores
nothing, to show what the audit events cost::

    python -m bench.scripts
    python -m bench.scripts --no-appendonly --calls 10000

Only this program's own server is touched; the figures are the median of
``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from celery_tooleffect import ToolEffect
from celery_tooleffect.events import AuditEvent
from celery_tooleffect.states import JournalState
from celery_tooleffect.store import journal as journal_module
from celery_tooleffect.store import lua
from celery_tooleffect.store.audit import StoredResult
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.leases import BrokerAck
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import Verdict
from celery_tooleffect.testing import redis_server, wait_for

#: Where the stub returns in ``prelude.lua``'s append_event (the second row).
_APPEND = "local function append_event(events, maxlen, ttl, fields, overrides)\n"


@contextmanager
def events_stubbed() -> Iterator[None]:
    """The package's scripts, while inside, with an ``append_event`` that stores
    nothing (a copy of each script: the shipped files are not changed)."""
    real = lua.script

    def stubbed(name: str) -> lua.LuaScript:
        shipped = real(name)
        if _APPEND not in shipped.text:
            raise RuntimeError("prelude.lua's append_event was renamed: update bench/scripts.py")
        return lua.LuaScript(name, shipped.text.replace(
            _APPEND, _APPEND + "  if true then return {'0', 0} end\n", 1))

    # The journal's name for it: the package's scripts are read once, by name.
    setattr(journal_module, "script", stubbed)  # noqa: B010 (mypy: not exported)
    try:
        yield
    finally:
        setattr(journal_module, "script", real)  # noqa: B010


def one_round(app: Celery, calls: int) -> dict[str, float]:
    """µs per call of the intent and the outcome script over ``calls`` writes."""
    runtime = runtime_for(app)
    journal, settings = runtime.journal, runtime.settings
    client = journal.client
    prefix = settings.key_prefix
    ids = [str(uuid.uuid4()) for _ in range(calls)]
    refs = [JournalRef(task_id, task_id) for task_id in ids]  # each call a run of its own
    tokens = [uuid.uuid4().hex for _ in refs]

    def event(ref: JournalRef, phase: str, status: str, **details: Any) -> AuditEvent:
        return AuditEvent.of(run_id=ref.run_id, task_id=ref.task_id, tool="bench.write",
                             effect=ToolEffect.NON_IDEMPOTENT_WRITE, phase=phase, status=status,
                             worker="bench:1", queue="bench", attempt=1, args_size="3",
                             kwargs_size="2", **details)

    # The messages the outcomes acknowledge, in kombu's unacked hash and index.
    client.hset(f"{prefix}unacked", mapping={token: "{}" for token in tokens})
    client.zadd(f"{prefix}unacked_index", {token: time.time() for token in tokens})
    figures: dict[str, float] = {}
    client.config_resetstat()
    for ref, token in zip(refs, tokens, strict=True):
        begin = journal.begin_attempt(
            ref, token=token, effect="non_idempotent_write", lease_end=time.time() + 3600,
            attempts_allowed=4, event=event(ref, "intent", "started"), tool="bench.write",
            call_digest="c767f2c4951965dab49daf49e75bd1e1", first_delivery=True)
        if begin.verdict is not Verdict.STARTED:
            raise RuntimeError(f"intent not started: {begin}")
    figures["intent"] = _usec_per_script(client)
    client.config_resetstat()
    for ref, token in zip(refs, tokens, strict=True):
        moved = journal.transition(
            ref, new_state=JournalState.SUCCEEDED,
            allowed=frozenset({JournalState.RUNNING}), token=token,
            event=event(ref, "outcome", "succeeded", duration_ms=0.013, result_size="1"),
            result=StoredResult(f"{prefix}celery-task-meta-{ref.task_id}",
                                '{"status": "SUCCESS", "result": 1}', 86400),
            ack=BrokerAck(token, f"{prefix}unacked", f"{prefix}unacked_index"))
        if not moved:
            raise RuntimeError(f"outcome not recorded: {moved}")
    figures["outcome"] = _usec_per_script(client)
    return figures


def _usec_per_script(client: Any) -> float:
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def measure(calls: int, rounds: int, *, appendonly: bool) -> dict[str, dict[str, float]]:
    """The median µs per call of each script, as shipped and with events stubbed out."""
    out: dict[str, dict[str, float]] = {}
    with redis_server("--appendfsync", "everysec", appendonly=appendonly) as server:
        wait_for(lambda: bool(server.client().ping()), timeout=10, what="redis")
        for label, stub in (("as shipped", False), ("append_event stubbed out", True)):
            samples: dict[str, list[float]] = {}
            for _ in range(rounds):
                prefix = f"bs{uuid.uuid4().hex[:6]}:"
                app = Celery(f"bench-scripts-{prefix}", set_as_current=False)
                app.conf.update(broker_url=server.url, result_backend=server.url,
                                tooleffect_key_prefix=prefix,
                                tooleffect_allow_volatile_store=not appendonly)
                if stub:
                    with events_stubbed():
                        figures = one_round(app, calls)
                else:
                    figures = one_round(app, calls)
                for name, value in figures.items():
                    samples.setdefault(name, []).append(value)
            out[label] = {name: statistics.median(values) for name, values in samples.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scripts",
                                     description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=3000, help="Writes per round.")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-appendonly", action="store_true",
                        help="A server that keeps nothing on disk (default: AOF, everysec).")
    args = parser.parse_args(argv)
    figures = measure(args.calls, args.rounds, appendonly=not args.no_appendonly)
    print("| scripts | intent µs | outcome µs | a write's two |")
    print("|---|---|---|---|")
    for label, row in figures.items():
        print(f"| {label} | {row['intent']:.1f} | {row['outcome']:.1f} | "
              f"{row['intent'] + row['outcome']:.1f} |")


if __name__ == "__main__":
    main()
