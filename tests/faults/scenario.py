"""What every fault scenario shares: its calls, its end-state checks, its summary line.

A scenario submits tool calls (``tests/apps/tool_app.py``, run by ``celery
worker`` subprocesses), injects real faults, waits until every call is final
(a SUCCESS on the result backend, or a dead letter) and then checks the end
state:

- nothing is lost: every call is final;
- no NON_IDEMPOTENT_WRITE body ran twice;
- no call both succeeded and became a dead letter;
- every write whose body ran has its intent in the audit log;
- every write whose body ran either has its outcome recorded (journal
  ``succeeded`` and an ``outcome succeeded`` event) or is a dead letter: no
  unrecorded write is acknowledged as if all were well.

The side effects are counted in the main Redis (the counters of tool_app), so
they survive any fault of the broker or of the store.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import redis
from celery import Celery

from celery_tooleffect import AuditLog, DeadLetters
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.lua import script
from celery_tooleffect.store.runtime import runtime_for

#: The tools of tests/apps/tool_app.py and their effects.
TOOLS = {
    "tools.read": "read_only",
    "tools.idempotent": "idempotent_write",
    "tools.write": "non_idempotent_write",
    "tools.write_deadline": "non_idempotent_write",
    "tools.charge": "non_idempotent_write",
}
EFFECTS = ("read_only", "idempotent_write", "non_idempotent_write")
#: The summary lines of the scenarios run in this session (see conftest.py).
REPORTED: list[str] = []
#: Three calls of each effect; one NON_IDEMPOTENT_WRITE has an operation_deadline
#: (so its lease is secured and a heartbeat runs while its body does).
MIX = (
    ["tools.read"] * 3 + ["tools.idempotent"] * 3
    + ["tools.write", "tools.write", "tools.write_deadline"]
)


@dataclass
class Call:
    task_id: str
    tool: str
    key: str

    @property
    def effect(self) -> str:
        return TOOLS[self.tool]

    @property
    def is_write(self) -> bool:
        return self.effect != "read_only"


@dataclass
class FaultRun:
    """The calls of one scenario and how they ended."""

    scenario: str
    #: Producer and reader: the worker's broker and result backend, and the
    #: store reached directly (never through a proxy the test breaks).
    app: Celery
    counters: redis.Redis
    prefix: str
    calls: list[Call] = field(default_factory=list)
    faults: int = 0
    #: Set when the scenario wiped the store: audit trails before it are gone.
    journal_lost: bool = False

    # -- driving ----------------------------------------------------------------

    def submit(self, tool: str, hold: float = 0.0, task_id: str | None = None) -> Call:
        key = uuid.uuid4().hex[:12]
        result = self.app.send_task(tool, args=[key, hold], queue="tools", task_id=task_id)
        call = Call(result.id, tool, key)
        self.calls.append(call)
        return call

    def submit_mix(self, hold: float = 0.0, tools: Iterable[str] = MIX) -> list[Call]:
        return [self.submit(tool, hold) for tool in tools]

    def deliver_again(self, call: Call) -> None:
        """Publish the same call again (same task id): a duplicate delivery."""
        self.app.send_task(call.tool, args=[call.key, 0.0], queue="tools", task_id=call.task_id)

    def release(self, calls: Iterable[Call] | None = None) -> None:
        """Let held bodies return."""
        for call in self.calls if calls is None else calls:
            self.counters.set(f"{self.prefix}release:{call.key}", 1, ex=600)

    def runs(self, call: Call) -> int:
        return int(self.counters.get(f"{self.prefix}count:{call.key}") or 0)

    def all_started(self, calls: Iterable[Call] | None = None) -> bool:
        return all(self.runs(call) >= 1 for call in (self.calls if calls is None else calls))

    # -- reading ------------------------------------------------------------------

    def state(self, call: Call) -> str:
        return str(self.app.AsyncResult(call.task_id).state)

    def letter(self, call: Call) -> DeadLetter | None:
        return DeadLetters(self.app).get(call.task_id)

    def journal(self, call: Call) -> dict[str, str]:
        return runtime_for(self.app).journal.read(JournalRef(call.task_id, call.task_id))

    def events(self, call: Call) -> list[dict[str, str]]:
        return AuditLog(self.app).events(call.task_id)

    def is_final(self, call: Call) -> bool:
        return self.state(call) == "SUCCESS" or self.letter(call) is not None

    def pending(self) -> list[Call]:
        return [call for call in self.calls if not self.is_final(call)]

    def settle(self, timeout: float = 60.0) -> list[Call]:
        """Wait (bounded) until every call is final; the calls that are not."""
        deadline = time.monotonic() + timeout
        pending = self.pending()
        while pending and time.monotonic() < deadline:
            time.sleep(0.2)
            pending = [call for call in pending if not self.is_final(call)]
        return pending

    # -- the end state --------------------------------------------------------------

    def summary(self) -> Summary:
        summary = Summary(self.scenario, tasks=len(self.calls), faults=self.faults)
        for call in self.calls:
            runs = self.runs(call)
            summary.executions[call.effect] += runs
            if call.effect == "non_idempotent_write" and runs > 1:
                summary.duplicates += 1
            letter = self.letter(call)
            if letter is not None:
                summary.dead_letters[letter.reason] += 1
            if not self.is_final(call):
                summary.lost += 1
        return summary

    def problems(self) -> list[str]:
        """What in the end state breaks a guarantee (empty when nothing)."""
        found = []
        for call in self.calls:
            what = f"{call.tool}[{call.task_id}]"
            runs = self.runs(call)
            letter = self.letter(call)
            succeeded = self.state(call) == "SUCCESS"
            if not succeeded and letter is None:
                found.append(f"{what} lost: neither succeeded nor dead-lettered")
            if succeeded and letter is not None:
                found.append(f"{what} both succeeded and dead-lettered ({letter.reason})")
            if call.effect == "non_idempotent_write" and runs > 1:
                found.append(f"{what} ran {runs} times")
            if not call.is_write or runs == 0:
                continue
            phases = [event["phase"] for event in self.events(call)]
            if not self.journal_lost and phases.count("intent") < 1:
                found.append(f"{what} ran {runs} time(s) without an intent in the audit log")
            recorded = (
                self.journal(call).get("state") == "succeeded"
                and any(event["phase"] == "outcome" and event["status"] == "succeeded"
                        for event in self.events(call))
            )
            # A store that lost records (journal_lost) may have lost a success's too.
            if succeeded and not recorded and not self.journal_lost:
                found.append(f"{what} succeeded but its outcome is not recorded")
            if not recorded and letter is None and not succeeded:
                found.append(f"{what} ran, its outcome is not recorded, and it is no dead letter")
        return found

    def diagnose(self, logs: Iterable[str] = ()) -> str:
        """The problems, with what is known of each call concerned (for failures)."""
        problems = self.problems()
        texts = list(logs)
        lines = [*problems]
        for call in self.calls:
            if not any(call.task_id in problem for problem in problems):
                continue
            lines.append(
                f"{call.tool}[{call.task_id}] runs={self.runs(call)} state={self.state(call)} "
                f"journal={self.journal(call)} letter={self.letter(call)} "
                f"phases={[(e['phase'], e['status']) for e in self.events(call)]}"
            )
            for text in texts:
                lines += [line for line in text.splitlines() if call.task_id in line][:20]
        return "\n".join(lines)

    def report(self) -> Summary:
        """Print the scenario's summary line (and keep it for the session's summary)."""
        summary = self.summary()
        print(summary.line())
        REPORTED.append(summary.line())
        return summary


@dataclass
class Summary:
    scenario: str
    tasks: int = 0
    faults: int = 0
    executions: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    lost: int = 0
    dead_letters: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        executions = " ".join(f"{effect}={self.executions[effect]}" for effect in EFFECTS)
        reasons = " ".join(f"{reason}={n}" for reason, n in sorted(self.dead_letters.items()))
        letters = f"{sum(self.dead_letters.values())}" + (f"[{reasons}]" if reasons else "")
        return (
            f"fault {self.scenario}: tasks={self.tasks} faults={self.faults} "
            f"executions[{executions}] duplicates={self.duplicates} lost={self.lost} "
            f"dead_letters={letters}"
        )


def broker_holds(broker: redis.Redis, prefix: str) -> int:
    """Messages of the tools queue still in the broker, waiting or unacknowledged."""
    return int(broker.llen(f"{prefix}tools")) + int(broker.hlen(f"{prefix}unacked"))


def load_scripts(client: redis.Redis) -> None:
    """Load the journal's scripts into a store beforehand, as a store in use has them.

    Then a script the worker gave up on (a timeout, a cut) runs when it
    arrives, instead of being answered NOSCRIPT.
    """
    for name in ("begin_attempt", "transition", "renew_lease", "append_event"):
        client.script_load(script(name).text)


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: every connection is refused."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])
    finally:
        sock.close()
