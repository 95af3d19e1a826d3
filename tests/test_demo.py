"""The README's first command, ``python -m celery_tooleffect.demo``, run as a
user runs it: on Redis servers of its own (never the one on 6379), on a Redis
it is named, and with ``--keep``, whose printed commands are run as printed.

The demo prints its six acts and, with ``--json``, writes what came of each
run; these tests check that against the documentation (How a task ends,
Approval before a write): each run's state, audit trail and journal, the
approval, the dead letter, how often each body ran. And what the demo leaves
behind: nothing, or with ``--keep`` what it says it keeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_tooleffect.demo.launch import ENV_REDIS_URL, ENV_WORKER
from celery_tooleffect.testing import pings, wait_for
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent


def demo_env(**extra: str) -> dict[str, str]:
    """The test's environment without any variable of the demo's: a user's
    first run, which names no Redis."""
    env = {name: value for name, value in os.environ.items()
           if name != ENV_REDIS_URL and name not in ENV_WORKER}
    return {**env, **extra}


@dataclass
class Demo:
    """What one run of the demo printed, and the summary it wrote (``--json``)."""

    output: str
    summary: dict[str, Any]


def run_demo(*arguments: str, env: dict[str, str] | None = None,
             expect: int = 0) -> Demo:
    with tempfile.TemporaryDirectory() as folder:
        summary = Path(folder) / "summary.json"
        done = subprocess.run(
            [sys.executable, "-m", "celery_tooleffect.demo", "--json", str(summary),
             *arguments], cwd=ROOT, capture_output=True, text=True, timeout=200,
            check=False, env=demo_env() if env is None else env,
        )
        assert done.returncode == expect, done.stdout[-6000:] + done.stderr[-3000:]
        written = json.loads(summary.read_text()) if summary.exists() else {}
    return Demo(done.stdout + done.stderr, written)


def found(pattern: str, output: str) -> str:
    match = re.search(pattern, output)
    assert match, f"{pattern!r} not in the output:\n{output[:3000]}"
    return match.group(1)


def prefix_of(output: str) -> str:
    return found(r"Key prefix for this demo: (\S+) ", output)


def own_servers(output: str) -> tuple[str, str]:
    """The broker's and the store's URL, both redis-servers of the demo's own."""
    return (found(r"Broker: a redis-server of the demo's own at (\S+) ", output),
            found(r"Audit store \(tooleffect_redis_url\): a redis-server of the demo's own "
                  r"at (\S+)", output))


def keys_under(url: str, prefix: str) -> list[bytes]:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return list(client.scan_iter(match=f"{prefix}*", count=1000))


def phases(run: dict[str, Any]) -> list[tuple[str, str]]:
    return [(phase, status) for phase, status in run["phases"]]


def assert_as_documented(summary: dict[str, Any]) -> None:
    """The six runs end as the documentation says (what the demo itself once
    checked before it exited)."""
    read, idempotent, invoice, approved, forced, charged = summary["runs"]
    effects = summary["effects"]
    assert (read["state"], read["result"]) == (
        "SUCCESS", ["usb-c cable 1m", "usb-c cable 2m"]), read
    assert phases(read) == [("outcome", "succeeded")], read
    for run in (idempotent, invoice):
        assert run["state"] == "SUCCESS", run
        assert phases(run) == [("intent", "started"), ("outcome", "succeeded")], run
        assert run["journal"]["state"] == "succeeded", run
    assert effects["address"] == "1 Main St, Springfield" and effects["invoices"] == 1

    # Act 4: parked and listed, its body not run, approved from the CLI, run once.
    approval = summary["approval"]
    assert approval["listed"] == [[approved["task_id"], "agent.email_customers",
                                   "pending"]], approval
    assert approval["emails_while_parked"] == 0, approval
    assert approval["exit_code"] == 0 and "1 approved" in approval["output"], approval
    assert (approved["state"], approved["result"]) == ("SUCCESS", "emailed 3 customers")
    assert effects["emails"] == 3, effects
    assert phases(approved) == [("approval", "requested"), ("approval", "approved"),
                                ("intent", "started"), ("outcome", "succeeded")], approved
    decided = [(event.get("actor"), event.get("via"), event.get("reason"))
               for event in approved["events"] if event.get("status") == "approved"]
    assert decided == [("demo", "cli", "the text was reviewed")], approved
    assert approved["journal"]["state"] == "succeeded", approved

    # Act 5: its body ran once, the outcome could not be recorded: failed
    # closed, dead-lettered, never retried.
    assert forced["state"] == "FAILURE" and effects["refunds"] == 1, forced
    assert ("intent", "started") in phases(forced), forced
    assert ("outcome", "succeeded") not in phases(forced), forced
    assert forced["dead_letter"] == {
        "reason": "not_retryable", "failure_class": "unknown", "body_completed": True,
        "exception_type": "AuditPersistenceFailed", "effect": "non_idempotent_write",
    }, forced

    # Act 6: one charge, one run of its body, reconciled after the crash.
    assert charged["state"] == "SUCCESS" and charged["result"].startswith("ch_"), charged
    assert effects["charge_requests"] == 1 and effects["charges"] == 1, effects
    # A redelivery that comes while the killed owner's lease still runs (the
    # visibility timeout counts from the fetch, the lease from the intent) is
    # deferred until the lease lapses: how many times depends on the timing.
    settled = [phase for phase in phases(charged) if phase != ("deferred", "owned_elsewhere")]
    assert settled == [("intent", "started"), ("interrupted", "lease_lapsed"),
                       ("reconcile", "applied"), ("outcome", "succeeded")], charged
    assert charged["journal"]["state"] == "succeeded", charged
    assert charged["dead_letter"] is None, charged


def assert_all_acts(demo: Demo) -> None:
    """The runs ended as documented, and the output tells each act's story:
    the call, the result, the journal, the audit trail and what they show."""
    assert_as_documented(demo.summary)
    output = demo.output
    starts = [output.index(run["title"] + "\n") for run in demo.summary["runs"]]
    for number, (start, end) in enumerate(zip(starts, [*starts[1:], len(output)], strict=True), 1):
        act = output[start:end]
        assert act.startswith(f"{number}. "), act
        for line in ("  tool agent.", "  result backend: ", "  audit trail (AuditLog(app)"):
            assert line in act, act
        assert ("  journal: state=" in act) == (number > 1), act
    assert ("cards charged=1 (the provider received 1 charge request(s))" in output), \
        output[-3000:]
    assert "refunds made=1" in output and "invoices sent=1" in output
    assert "emails sent=3" in output
    act4 = output[output.index("4. NON_IDEMPOTENT_WRITE that needs a person's approval"):]
    assert "approval  approved" in act4 and "demo (cli)" in act4
    assert "result backend: SUCCESS: 'emailed 3 customers'" in act4
    act6 = output[output.index("6. NON_IDEMPOTENT_WRITE interrupted"):]
    assert "reconcile    applied" in act6 and "result backend: SUCCESS: 'ch_" in act6


def test_the_demo_runs_on_redis_servers_of_its_own_and_leaves_the_default_alone() -> None:
    demo = run_demo()
    assert_all_acts(demo)
    output = demo.output
    # The approval act: parked and listed, then approved by the CLI subprocess.
    assert re.search(r"\S+\s+agent\.email_customers\s+agent-tools\s+pending", output), output
    assert "tooleffect approvals approve" in output and "1 approved, 0 refused" in output

    broker_url, store_url = own_servers(output)
    assert broker_url != REDIS_URL and store_url != REDIS_URL
    prefix = prefix_of(output)
    # The suite's Redis may hold other tests' keys: only the demo's prefix counts.
    assert keys_under(REDIS_URL, prefix) == []
    # Without --keep, what it started is stopped.
    assert "Cleaned up: deleted" in output
    assert not pings(broker_url) and not pings(store_url)


def test_the_demo_runs_on_the_redis_it_is_named() -> None:
    # --redis-url wins over the variable (which names a Redis that is not there).
    demo = run_demo("--redis-url", REDIS_URL,
                    env=demo_env(**{ENV_REDIS_URL: "redis://127.0.0.1:1/0"}))
    output = demo.output
    assert f"Broker: the Redis you named, at {REDIS_URL}" in output
    assert_all_acts(demo)
    # Its keys are deleted from the named Redis; its audit store is stopped.
    assert keys_under(REDIS_URL, prefix_of(output)) == []
    store_url = found(r"Audit store \(tooleffect_redis_url\): a redis-server of the demo's "
                      r"own at (\S+)", output)
    assert not pings(store_url)


def test_a_named_redis_that_does_not_answer_is_an_error_not_a_fallback() -> None:
    # The variable of earlier releases still names the broker; the demo no
    # longer starts one of its own in place of a Redis it was named.
    output = run_demo(env=demo_env(**{ENV_REDIS_URL: "redis://127.0.0.1:1/0"}),
                      expect=1).output
    assert (f"No Redis answers at redis://127.0.0.1:1/0 (named by ${ENV_REDIS_URL})"
            in output)
    assert "Broker:" not in output


@dataclass
class Kept:
    """What a ``--keep`` run printed: its output, the shell lines that open what
    it kept, and the one that stops its servers."""

    demo: Demo
    exports: list[str]
    commands: list[str]
    stop: str

    @property
    def output(self) -> str:
        return self.demo.output


def kept_lines(demo: Demo) -> Kept:
    block = demo.output[demo.output.index("Kept (--keep):"):]
    lines = [line.strip() for line in block.splitlines() if line.startswith("    ")]
    exports = [line for line in lines if line.startswith("export ")]
    commands = [line for line in lines if " tooleffect " in line]
    [stop] = [line for line in lines if line.startswith("kill ")]
    return Kept(demo, exports, commands, stop)


def verb(line: str) -> str:
    """``dlq show`` of ``celery -A app tooleffect dlq show ID``."""
    words = shlex.split(line)
    start = words.index("tooleffect") + 1
    return " ".join(words[start:start + 2])


def shell(kept: Kept, line: str) -> subprocess.CompletedProcess[str]:
    """``line`` pasted in a shell after the export lines, as a user does."""
    script = "\n".join([*kept.exports, line])
    return subprocess.run(["bash", "-c", script], cwd="/", capture_output=True, text=True,
                          timeout=120, check=False,
                          env=demo_env(COLUMNS="200", TOOLEFFECT_ACTOR="test"))


@pytest.fixture
def kept_run() -> Iterator[Kept]:
    """``python -m celery_tooleffect.demo --keep``; afterwards, its servers are
    stopped even when the test failed before it ran the printed stop line."""
    demo = run_demo("--keep")
    output = demo.output
    pids = [int(pid) for pid in found(r"\n    kill ([\d ]+) && rm -rf", output).split()]
    ports = [url.split(":")[2].split("/")[0] for url in own_servers(output)]
    try:
        yield kept_lines(demo)
    finally:
        for pid in pids:
            # Only a server of this run still running (its pid is not reused).
            with contextlib.suppress(OSError):
                # (redis-server rewrites its title: "redis-server 127.0.0.1:PORT")
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"redis-server" in command and any(port.encode() in command
                                                      for port in ports):
                    os.kill(pid, signal.SIGKILL)
        folder = found(r"&& rm -rf (\S+)", output)
        shutil.rmtree(shlex.split(folder)[0], ignore_errors=True)


def test_keep_leaves_its_data_and_prints_commands_that_open_it(kept_run: Kept) -> None:
    output = kept_run.output
    assert_all_acts(kept_run.demo)
    broker_url, store_url = own_servers(output)
    prefix = prefix_of(output)
    assert "Cleaned up" not in output
    assert keys_under(broker_url, prefix) and keys_under(store_url, prefix)
    assert keys_under(REDIS_URL, prefix) == []
    letter_id = found(r"The dead letter of run 5.*\n\s+task_id\s+(\S+)", output)
    approved_id = found(r"4\. NON_IDEMPOTENT_WRITE that needs.*\n.*\n  task id / run id: (\S+)",
                        output)
    assert kept_run.exports == [f"export TOOLEFFECT_DEMO_BROKER={broker_url}",
                                f"export TOOLEFFECT_DEMO_STORE={store_url}",
                                f"export TOOLEFFECT_DEMO_PREFIX={prefix}"]

    by_verb = {verb(line): line for line in kept_run.commands}
    listed = shell(kept_run, by_verb["dlq list"])
    assert listed.returncode == 0, listed.stderr
    assert letter_id in listed.stdout and "not_retryable" in listed.stdout

    shown = shell(kept_run, by_verb["dlq show"])
    assert shown.returncode == 0, shown.stderr
    assert letter_id in shown.stdout and "AuditPersistenceFailed" in shown.stdout
    assert "agent.refund_payment" in shown.stdout

    audits = [line for line in kept_run.commands if " audit show " in line]
    assert [line.split()[-1] for line in audits] == [letter_id, approved_id]
    trail = shell(kept_run, audits[0])
    assert trail.returncode == 0, trail.stderr
    assert re.search(r"intent\s+started", trail.stdout), trail.stdout
    trail = shell(kept_run, audits[1])
    assert trail.returncode == 0, trail.stderr
    phases = re.findall(r"(approval|intent|outcome)\s+(requested|approved|started|succeeded)",
                        trail.stdout)
    assert phases == [("approval", "requested"), ("approval", "approved"),
                      ("intent", "started"), ("outcome", "succeeded")], trail.stdout

    approval = shell(kept_run, by_verb["approvals show"])
    assert approval.returncode == 0, approval.stderr
    assert "approved" in approval.stdout and "the text was reviewed" in approval.stdout

    # Flower is not started (it serves until stopped): its command is well formed.
    flower = shlex.split(by_verb["flower --address=127.0.0.1"])
    launcher = flower[:flower.index("-A")]
    assert flower[len(launcher):] == ["-A", "celery_tooleffect.demo.worker_app", "tooleffect",
                                      "flower", "--address=127.0.0.1", "--port=5555"]
    version = shell(kept_run, shlex.join([*launcher, "--version"]))
    assert version.returncode == 0 and re.match(r"\d+\.\d+", version.stdout), version
    assert f"http://127.0.0.1:5555/dead-letters/{letter_id}" in output
    assert f"http://127.0.0.1:5555/approvals/{approved_id}" in output

    # The printed stop line stops both servers and deletes their files.
    stopped = subprocess.run(["bash", "-c", kept_run.stop], capture_output=True, text=True,
                             timeout=60, check=False)
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not pings(broker_url) and not pings(store_url), timeout=20,
             what="the kept servers to stop")
    assert not Path(shlex.split(kept_run.stop.split("rm -rf ", 1)[1])[0]).exists()
