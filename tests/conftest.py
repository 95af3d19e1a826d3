"""Fixtures: a real Redis, real Celery workers, real faults.

Every key a test writes lives under its own prefix (broker, result backend,
journal, audit, dead letters and side-effect counters alike), so tests can run
side by side and clean up only what they created.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_tooleffect.store.dead_letters import DeadLetters
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import JournalState

# The process helpers live in the package (the demo, bench/ and chaos/ use them
# too); they are imported here so that tests keep ``from tests.conftest import``.
from celery_tooleffect.testing import (
    REDIS_URL,
    RedisServer,
    WorkerProcess,
    app_config,
    delete_keys,
    free_port,
    redis_server,
    redis_server_binary,
    start_celery_worker,
    wait_for,
)

__all__ = [
    "FAULT_LINE",
    "REDIS_URL",
    "TESTS",
    "Counter",
    "RedisServer",
    "WorkerProcess",
    "app_config",
    "dead_lettering_ended",
    "free_port",
    "on_broker",
    "rabbitmq_queues",
    "redis_server",
    "redis_server_binary",
    "running_worker",
    "start_celery_worker",
    "wait_for",
]

TESTS = Path(__file__).parent


# -- markers (registered in pyproject.toml; `make test-fast` deselects them) ---------

#: Tests that take about 15 s or more: 11 s or more (call time) when measured
#: with ``pytest --durations`` on a 2-core machine, Redis and RabbitMQ on
#: loopback. A key is a file, a test (every parameter) or one node id; the
#: value is what it took (redis, rabbitmq where a test runs on both brokers).
#: Measured and below the line: the compose stack 1.6 / 3.2 s, test_fuzz.py
#: 2.4 s at most, the quorum queue 10.8 s, a deadline longer than the
#: visibility timeout 10.1 s, the broker restart 7.6 s, test_access.py 8.1 s.
SLOW: dict[str, str] = {
    "tests/test_bench.py": "48.2 s",
    "tests/test_crash.py": "22.8 s / 19.4 s",
    "tests/faults/test_partition.py": "13.3 s / 13.4 s",
    "tests/faults/test_restarts.py::"
    "test_store_restarts_without_persistence_after_a_worker_died_mid_write": "13.3 s",
    "tests/test_rabbitmq.py::"
    "test_a_write_whose_outcome_cannot_be_stored_keeps_its_message_until_the_store_is_back":
        "12.6 s",
    "tests/faults/test_store_connection_cut.py::"
    "test_random_cuts_while_calls_run_lose_nothing_and_never_run_a_write_twice": "11.5 s",
    "tests/test_leases.py::"
    "test_a_second_delivery_while_the_owner_runs_is_deferred_then_settled": "11.2 s",
    "tests/test_dlq_scale.py": "11.2 s",
    "tests/test_pytest_plugin.py": "73.3 s (both)",
    "tests/test_examples_plugin.py": "312.2 s",
    "tests/test_demo.py": "30.7 s (all four)",
}


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C (SIGINT) works in the processes the tests start, however pytest
    was started. A shell without job control starts a background job (``cmd &``
    in a script, e.g. on a CI runner) with SIGINT ignored, its children inherit
    that, and Python installs no KeyboardInterrupt handler in a process started
    so: a test that stops a CLI with SIGINT (test_cli.py's ``audit tail
    --follow``) would wait for it forever. Under pytest-xdist each worker runs
    this too."""
    if (signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGINT, signal.default_int_handler)


#: Tests that run by themselves after the parallel run (``make test`` and
#: .ci/run run ``-m "not alone"`` under xdist, then ``-m alone``): the
#: Sentinels' failure detection and failover are timed (down after 1 s), and
#: on a starved machine they promoted a replica that did not stay master.
#: The other two race a worker's own steps, and failed now and then beside
#: three other xdist workers (a replay while its dead letter is still being
#: ended lets the member's failure reach the chord; an outcome that cannot be
#: stored met its redelivery before the worker had dead-lettered it).
ALONE = (
    "tests/faults/test_failover.py",
    "tests/test_replay.py::test_chord_member_replayed_while_its_chord_waits_completes_the_chord_once",
    "tests/test_rabbitmq.py::"
    "test_a_write_whose_outcome_cannot_be_stored_keeps_its_message_until_the_store_is_back",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark by where a test is: tests/faults/ ``faults``, test_cluster.py
    ``cluster``, a test that drives a browser (the ``browser`` fixture of
    test_flower.py) ``browser``, the tests of :data:`SLOW` ``slow``."""
    faults = TESTS / "faults"
    for item in items:
        path = Path(item.path)
        if faults in path.parents:
            item.add_marker(pytest.mark.faults)
        if path.name == "test_cluster.py":
            item.add_marker(pytest.mark.cluster)
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
        if any(_names(item.nodeid, slow) for slow in SLOW):
            item.add_marker(pytest.mark.slow)
        if any(_names(item.nodeid, alone) for alone in ALONE):
            item.add_marker(pytest.mark.alone)
    if hasattr(config, "workerinput"):
        # An xdist worker (every worker sorts alike: they must collect the same
        # order). The longest tests first, so that the 5-minute example
        # matrix does not start last and leave the other workers idle at the
        # end (longest-first scheduling); the rest keep their order.
        items.sort(key=lambda item: -_seconds(item.nodeid))


def _seconds(nodeid: str) -> float:
    """What :data:`SLOW` says ``nodeid`` took (its first figure), or 0."""
    for entry, took in SLOW.items():
        if _names(nodeid, entry):
            return float(took.split()[0])
    return 0.0


#: The ``user_properties`` name of a fault scenario's summary line (set by
#: tests/faults/conftest.py, from :data:`tests.faults.scenario.REPORTED`).
FAULT_LINE = "fault scenario"
#: The lines of the session, in the order the tests ended (all workers').
_FAULT_LINES: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep a test's fault summary lines; its teardown report holds them all.
    Under xdist this runs in the controller too, with the workers' reports."""
    if report.when == "teardown":
        _FAULT_LINES.extend(str(value) for name, value in report.user_properties
                            if name == FAULT_LINE)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The fault scenarios' summary lines, repeated at the end of the session."""
    if _FAULT_LINES and not hasattr(config, "workerinput"):  # not in an xdist worker
        terminalreporter.section("fault scenarios")
        for line in _FAULT_LINES:
            terminalreporter.write_line(line)


def _names(nodeid: str, entry: str) -> bool:
    """Whether ``entry`` (a file, a test or one of its parameters) names ``nodeid``."""
    return nodeid == entry or nodeid.startswith((f"{entry}::", f"{entry}["))


def dead_lettering_ended(app: Celery, task_id: str) -> None:
    """Wait until the worker has ended a dead letter's record: it stores the
    letter (what a test waits for) a moment before it moves the journal from
    ``dead_lettering`` to ``dead_lettered`` (worker/letters.py). A replay in that
    moment is allowed and fences that worker, whose end is then recorded as a
    ``late_outcome`` (a NON_IDEMPOTENT_WRITE is then not replayed again, a chord
    member's failure may still reach its chord, the replayed run's audit trail
    starts with it). A busy machine (the tests side by side under pytest-xdist)
    makes that moment long enough; a test that replays a letter waits here first."""
    letter = DeadLetters(app).get(task_id)
    ref = JournalRef(letter.run_id or task_id if letter else task_id, task_id)
    journal = runtime_for(app).journal
    wait_for(lambda: journal.read(ref).get("state") != JournalState.DEAD_LETTERING,
             what=f"the journal of {task_id} to leave dead_lettering")


@pytest.fixture
def second_redis() -> Iterator[RedisServer]:
    """A second redis-server the test owns and may break (e.g. as the audit store)."""
    with redis_server() as server:
        yield server


RABBITMQ_URL = os.environ.get("TOOLEFFECT_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")


def rabbitmq_queues(queue_type: str = "classic", delivery_limit: int = 0) -> dict[str, Any]:
    """Celery settings that declare the queue ``tools`` on RabbitMQ: classic, or
    quorum (``x-delivery-limit`` when given). Producer and workers must agree:
    RabbitMQ refuses to declare a queue again with other arguments."""
    if queue_type == "classic":
        return {}
    from kombu.entity import Exchange, Queue

    arguments: dict[str, Any] = {"x-queue-type": queue_type}
    if delivery_limit:
        arguments["x-delivery-limit"] = delivery_limit
    return {
        "task_default_queue_type": queue_type,
        "task_queues": [Queue(  # type: ignore[no-untyped-call]
            "tools", Exchange("tools", type="direct"),  # type: ignore[no-untyped-call]
            routing_key="tools", queue_arguments=arguments,
        )],
    }


def on_broker(prefix: str, broker_url: str, **transport: Any) -> dict[str, Any]:
    """Celery settings that put an app of the test's on ``broker_url``.

    On Redis every key goes under ``prefix`` (``transport`` adds transport
    options); on RabbitMQ the test has a virtual host of its own, the journal
    heartbeat is short (0.5 s) and results, journal and audit stay on Redis.
    """
    if broker_url.startswith("redis"):
        return {"broker_url": broker_url, "broker_transport_options": {
            "global_keyprefix": prefix, "visibility_timeout": 60, **transport}}
    return {"broker_url": broker_url, "broker_transport_options": {},
            "tooleffect_redis_url": REDIS_URL, "tooleffect_heartbeat_interval": 0.5}


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each test that asks for it runs on both brokers (RabbitMQ: a vhost of its own)."""
    if request.param == "redis":
        return REDIS_URL
    return str(request.getfixturevalue("rabbitmq_url"))


@pytest.fixture
def rabbitmq_url() -> Iterator[str]:
    """A RabbitMQ virtual host of this test's own (deleted afterwards), as a broker URL.

    Made with ``rabbitmqctl`` on the machine's RabbitMQ, so that no queue,
    message or consumer of another test is ever seen.
    """
    vhost = f"te-{uuid.uuid4().hex[:12]}"
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", vhost], check=True, timeout=60)
    subprocess.run(["rabbitmqctl", "-q", "set_permissions", "-p", vhost, "guest",
                    ".*", ".*", ".*"], check=True, timeout=60)
    yield f"{RABBITMQ_URL}/{vhost}"
    subprocess.run(["rabbitmqctl", "-q", "delete_vhost", vhost], check=False, timeout=60)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    value = f"tetest:{uuid.uuid4().hex[:12]}:"
    yield value
    delete_keys(REDIS_URL, value)


@pytest.fixture
def main_redis() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, socket_timeout=5)


@pytest.fixture
def make_app(prefix: str) -> Callable[..., Celery]:
    """Build a Celery app whose keys all live under the test's prefix."""

    def build(**overrides: Any) -> Celery:
        app = Celery(f"tooltest-{uuid.uuid4().hex[:6]}", set_as_current=False)
        app.conf.update(app_config(prefix, **overrides))
        return app

    return build


@contextmanager
def running_worker(app: Celery, concurrency: int = 2) -> Iterator[Any]:
    """An in-process worker (threads pool) consuming the app's default queue."""
    with start_worker(
        app, pool="threads", concurrency=concurrency, perform_ping_check=False,
        loglevel="WARNING", shutdown_timeout=15,
    ) as worker:
        yield worker


@dataclass
class Counter:
    """A side-effect counter in Redis: how many times a tool body really ran."""

    client: redis.Redis
    prefix: str

    def key(self, name: str) -> str:
        return f"{self.prefix}count:{name}"

    def hit(self, name: str) -> int:
        return int(self.client.incr(self.key(name)))

    def value(self, name: str) -> int:
        return int(self.client.get(self.key(name)) or 0)


@pytest.fixture
def counter(main_redis: redis.Redis, prefix: str) -> Counter:
    return Counter(main_redis, prefix)


@pytest.fixture
def app_workers(
    prefix: str, tmp_path: Path, broker_url: str
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``celery -A <tests.apps module> worker`` subprocesses on the test's
    broker (TE_PREFIX, TE_BROKER set); killed at the end of the test."""
    started: list[WorkerProcess] = []

    def spawn(module: str, *, pool: str = "prefork", concurrency: int = 2,
              wait: bool = True, **env: str) -> WorkerProcess:
        worker = start_celery_worker(
            module, tmp_path / f"worker-{len(started)}.log", pool=pool,
            concurrency=concurrency, name=module.rsplit(".", 1)[-1], wait=wait,
            root=TESTS.parent,
            env=dict(TE_PREFIX=prefix, TE_BROKER=broker_url, **env),
        )
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.kill()


@pytest.fixture
def spawn_worker(prefix: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``celery -A tests.apps.tool_app worker`` subprocesses; stopped at the end."""
    started: list[WorkerProcess] = []

    def spawn(concurrency: int = 1, visibility_timeout: float = 60.0,
              store_url: str | None = None, broker_url: str | None = None,
              **env: str) -> WorkerProcess:
        # Side-effect counters stay on the main Redis whichever broker is used;
        # on RabbitMQ the journal heartbeat is short (as in ``on_broker``).
        if broker_url and not broker_url.startswith("redis"):
            env.setdefault("TE_HEARTBEAT", "0.5")
        worker = start_celery_worker(
            "tests.apps.tool_app", tmp_path / f"worker-{len(started)}.log",
            concurrency=concurrency, name=f"w{len(started)}", root=TESTS.parent,
            env=dict(TE_PREFIX=prefix, TE_BROKER=broker_url or REDIS_URL,
                     TE_COUNTERS=REDIS_URL, TE_VT=str(visibility_timeout),
                     TE_STORE=store_url or "", **env),
        )
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.kill()
