"""Fixtures: a real Redis, real Celery workers, real faults.

Every key a test writes lives under its own prefix (broker, result backend,
journal, audit, dead letters and side-effect counters alike), so tests can run
side by side and clean up only what they created.

The suite uses only the servers it starts or is given: the Redis of
``TOOLEFFECT_TEST_REDIS_URL`` (default 127.0.0.1:6379), RabbitMQ virtual hosts
it makes on the RabbitMQ of ``TOOLEFFECT_TEST_RABBITMQ_URL``, and servers a
test starts itself. Two guards hold it to that (see "the machine's servers"
below): no app of the suite falls back to a default server (the package's
store of a RabbitMQ app that names none is refused, in every process that
imports this module: the tests and every app they spawn), and when the suite
is given another Redis, the one on 127.0.0.1:6379 is checked after each test,
and at the end of the session, for keys of the test's prefix.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu.utils.url import url_to_parts

from celery_tooleffect import settings as package_settings
from celery_tooleffect.endpoints import is_redis_family, resolve
from celery_tooleffect.errors import ConfigurationError
from celery_tooleffect.store.dead_letters import DeadLetters
from celery_tooleffect.store.journal import JournalRef
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.states import JournalState

# The process helpers live in the package (the demo and the pytest plugin use
# them too), the suite's settings and TCP proxy in tests/support.py (bench/ and
# chaos/ use them too); they are imported here so that tests keep
# ``from tests.conftest import``.
from celery_tooleffect.testing import (
    RedisServer,
    WorkerProcess,
    delete_keys,
    free_port,
    redis_server,
    redis_server_binary,
    start_celery_worker,
    wait_for,
)
from tests import support
from tests.support import REDIS_URL

__all__ = [
    "FAULT_LINE",
    "RABBITMQ_URL",
    "REDIS_URL",
    "TESTS",
    "Counter",
    "DefaultServerRefused",
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
    "spawned_setting",
    "start_celery_worker",
    "wait_acknowledged",
    "wait_for",
]

TESTS = Path(__file__).parent


# -- the machine's servers: the suite uses those it started or was given, no other ---


class DefaultServerRefused(RuntimeError):
    """An app of the suite would reach a server nobody named: a default one."""


#: The Redis a machine may run for its own use, and where the package's store
#: of an app whose broker is not Redis and that names no store would be.
MACHINE_REDIS = ("127.0.0.1", 6379)
#: The package's fallback store (:data:`celery_tooleffect.settings.DEFAULT_STORE_URL`),
#: as it was before the suite refused it below (tests/unit asserts it).
PACKAGE_DEFAULT_STORE_URL = package_settings.DEFAULT_STORE_URL
#: What the fallback store becomes in every process that imports this module:
#: the tests, and every app they spawn (tests/apps/ import it). It is not a
#: Redis URL, so an app that would fall back to it is refused when its
#: settings are read (a ConfigurationError that says this) instead of
#: writing into whatever Redis answers on 127.0.0.1:6379. The settings read
#: the module's global each time (settings._read), so this replaces it.
REFUSED_DEFAULT_STORE = (
    "refused://the test suite refuses the package's default store (127.0.0.1:6379): an app "
    "of the suite whose broker is not Redis names its store (tooleffect_redis_url)"
)
package_settings.DEFAULT_STORE_URL = REFUSED_DEFAULT_STORE


def app_config(prefix: str, **overrides: Any) -> dict[str, Any]:
    """The suite's Celery settings (:func:`tests.support.app_config`),
    refused when they would reach a server nobody named (:func:`refuse_defaults`)."""
    conf = support.app_config(prefix, **overrides)
    refuse_defaults(conf)
    return conf


def refuse_defaults(conf: Mapping[str, Any]) -> None:
    """Refuse Celery settings that leave a server to a default: no broker
    (Celery's is ``amqp://guest@localhost//``), a broker that is not Redis
    without ``tooleffect_redis_url`` (the package's store would then be
    127.0.0.1:6379), a RabbitMQ broker on its default virtual host."""
    broker = str(conf.get("broker_url") or "")
    if not broker:
        raise DefaultServerRefused("no broker_url: Celery's default broker is nobody's")
    if is_redis_family(broker):
        return
    if not conf.get("tooleffect_redis_url"):
        raise DefaultServerRefused(
            f"broker {broker.split('://', 1)[0]}:// and no tooleffect_redis_url: the package's "
            "store would be 127.0.0.1:6379, a server the test did not name "
            "(on_broker() names the suite's Redis)")
    if broker.split("://", 1)[0] in ("amqp", "amqps", "pyamqp") and (
            url_to_parts(broker).path or "/") == "/":
        raise DefaultServerRefused(
            "a RabbitMQ broker on the default virtual host: a test has a virtual host of its "
            "own (the rabbitmq_url fixture)")


def spawned_setting(name: str) -> str:
    """``os.environ[name]`` in an app the suite spawns (tests/apps/): the server
    it names is never left to a default; refused when unset."""
    value = os.environ.get(name)
    if not value:
        raise DefaultServerRefused(
            f"{name} is not set: the tests name every server an app they spawn uses")
    return value


def _machine_redis_is_the_suites() -> bool:
    """Whether the suite's Redis (:data:`REDIS_URL`) is the one on 127.0.0.1:6379."""
    try:
        endpoint = resolve(REDIS_URL, setting="TOOLEFFECT_TEST_REDIS_URL")
    except ConfigurationError:
        return False  # a form only the tests that use it can tell: checked as another
    options = endpoint.options
    return (not endpoint.behind_sentinel and not options.get("path")
            and str(options.get("host") or "127.0.0.1") in ("127.0.0.1", "localhost")
            and int(options.get("port") or 6379) == MACHINE_REDIS[1])


#: A client of the machine's Redis when the suite was given another Redis and
#: it answers (else None); found at the first check, once per process.
_machine_redis: list[redis.Redis | None] = []


def machine_redis() -> redis.Redis | None:
    if not _machine_redis:
        client: redis.Redis | None = None
        if not _machine_redis_is_the_suites():
            client = redis.Redis(*MACHINE_REDIS, socket_timeout=5, socket_connect_timeout=1)
            try:
                client.ping()
            except (redis.RedisError, OSError):
                client.close()
                client = None
        _machine_redis.append(client)
    return _machine_redis[0]


def keys_on_the_machine_redis(pattern: str) -> list[tuple[int, bytes]]:
    """The keys matching ``pattern`` in every database of the machine's Redis
    (none when it is the suite's, or does not answer): (db, key) pairs."""
    client = machine_redis()
    if client is None:
        return []
    found: list[tuple[int, bytes]] = []
    try:
        databases = [int(name[2:]) for name in client.info("keyspace")]
        for db in databases:
            with redis.Redis(*MACHINE_REDIS, db=db, socket_timeout=5) as each:
                found.extend((db, key) for key in each.scan_iter(match=pattern, count=1000))
    except redis.RedisError:
        return found  # it went away: nothing more to find
    return found


def refuse_keys_on_the_machine_redis(prefix: str) -> None:
    """Fail the test when a key of its ``prefix`` is in the machine's Redis
    although the suite was given another one; the keys are deleted first
    (they are the test's own)."""
    leaked = keys_on_the_machine_redis(f"{prefix}*")
    if not leaked:
        return
    _delete_on_the_machine_redis(leaked)
    shown = ", ".join(f"db{db} {key.decode(errors='replace')}" for db, key in leaked[:8])
    pytest.fail(
        f"{len(leaked)} key(s) of this test's prefix were written to the Redis on "
        f"127.0.0.1:6379, which the suite was not given (TOOLEFFECT_TEST_REDIS_URL="
        f"{REDIS_URL}): {shown}{' ...' if len(leaked) > 8 else ''} (deleted). "
        "Something the test started fell back to a default server.", pytrace=False)


def _delete_on_the_machine_redis(keys: list[tuple[int, bytes]]) -> None:
    """Delete keys a test left in the machine's Redis (they are the test's own)."""
    for db in sorted({db for db, _ in keys}):
        with redis.Redis(*MACHINE_REDIS, db=db, socket_timeout=5) as each:
            each.delete(*[key for key_db, key in keys if key_db == db])


#: The ``user_properties`` name of a test's key prefix (the ``prefix``
#: fixture), which reaches the xdist controller with the test's report.
PREFIX_PROPERTY = "tooleffect test prefix"
#: The prefixes of the session's tests (all workers'), for the session's check.
_PREFIXES: set[str] = set()
#: What the session's check found (printed in the summary).
_LEAKED_AT_THE_END: list[str] = []
#: The RabbitMQ tests that were skipped (all workers'): a failure under CI.
_SKIPPED_ON_RABBITMQ: list[str] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's checks, run once, by the xdist controller (or the only
    process): no key of any of its tests' prefixes is left in the machine's
    Redis when the suite was given another one (what a process of a test
    wrote after that test ended); under :data:`REQUIRE_RABBITMQ` (CI), no
    test marked ``rabbitmq`` was skipped, whatever skipped it."""
    if hasattr(session.config, "workerinput"):
        return
    if REQUIRE_RABBITMQ and _SKIPPED_ON_RABBITMQ:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not _PREFIXES:
        return
    leaked = [(db, key) for db, key in keys_on_the_machine_redis("tetest:*")
              if ":".join(key.decode(errors="replace").split(":")[:2]) + ":" in _PREFIXES]
    if leaked:
        _LEAKED_AT_THE_END.extend(f"db{db} {key.decode(errors='replace')}" for db, key in leaked)
        _delete_on_the_machine_redis(leaked)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
    "tests/test_cluster_rabbitmq.py::"
    "test_effects_dead_letters_replay_and_approvals_on_rabbitmq_with_a_cluster_store": "16.2 s",
    "tests/test_pytest_plugin.py": "73.3 s (both)",
    "tests/test_examples_plugin.py": "312.2 s",
    "tests/test_demo.py": "95.3 s (all four)",
    "tests/test_replication.py::"
    "test_a_store_short_of_replicas_starts_runs_reads_and_holds_writes": "11.4 s",
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
#: The others race a worker's own steps, and failed now and then beside
#: three other xdist workers (a replay while its dead letter is still being
#: ended lets the member's failure reach the chord; an outcome that cannot be
#: stored met its redelivery before the worker had dead-lettered it; the
#: broker filled while the worker still waits out a busy lease, for at most
#: 2 s, which a starved worker spent before the test filled it).
ALONE = (
    "tests/faults/test_failover.py",
    "tests/test_replay.py::test_chord_member_replayed_while_its_chord_waits_completes_the_chord_once",
    "tests/test_rabbitmq.py::"
    "test_a_write_whose_outcome_cannot_be_stored_keeps_its_message_until_the_store_is_back",
    "tests/test_deadline_paths.py::"
    "test_a_lease_the_broker_cannot_extend_is_audited_and_the_message_kept",
    # Sentinel's view of a replica that is down, and back, is timed too.
    "tests/test_replication.py::"
    "test_behind_sentinel_a_replica_down_at_start_holds_writes_until_it_is_back",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark by where a test is: tests/faults/ ``faults``, test_cluster.py
    ``cluster``, a test that drives a browser (the ``browser`` fixture of
    test_flower.py) ``browser``, the tests of :data:`SLOW` ``slow``, a test
    on RabbitMQ (:func:`_on_rabbitmq`) ``rabbitmq``. Without the suite's
    Redis (:func:`suite_redis_unavailable`) every test outside tests/unit is
    skipped, saying why."""
    faults = TESTS / "faults"
    unit = TESTS / "unit"
    no_redis = suite_redis_unavailable()
    for item in items:
        path = Path(item.path)
        if no_redis is not None and unit not in path.parents:
            item.add_marker(pytest.mark.skip(reason=no_redis))
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
        if _on_rabbitmq(item):
            item.add_marker(pytest.mark.rabbitmq)
    if hasattr(config, "workerinput"):
        # An xdist worker (every worker sorts alike: they must collect the same
        # order). The longest tests first, so that the 5-minute example
        # matrix does not start last and leave the other workers idle at the
        # end (longest-first scheduling); the rest keep their order.
        items.sort(key=lambda item: -_seconds(item.nodeid))


#: Why the suite's Redis cannot be used (:func:`suite_redis_unavailable`);
#: found once per process.
_redis_state: list[str | None] = []


def suite_redis_unavailable() -> str | None:
    """Why the suite's Redis, the one on 127.0.0.1:6379, does not answer, or
    None. Nearly every test outside tests/unit uses it (its apps' broker,
    results and store). A Redis that ``TOOLEFFECT_TEST_REDIS_URL`` names is
    not checked: whoever names one has it running."""
    if not _redis_state:
        why: str | None = None
        if _machine_redis_is_the_suites():
            client = redis.Redis(*MACHINE_REDIS, socket_timeout=3, socket_connect_timeout=3)
            try:
                client.ping()
            except (redis.RedisError, OSError) as exc:
                why = (f"no Redis answers at 127.0.0.1:6379 ({exc}): the tests outside "
                       "tests/unit need it; scripts/services.sh (make test) starts one, "
                       "TOOLEFFECT_TEST_REDIS_URL names another")
            finally:
                client.close()
        _redis_state.append(why)
    return _redis_state[0]


def _on_rabbitmq(item: pytest.Item) -> bool:
    """Whether ``item`` needs RabbitMQ: it asks for ``rabbitmq_url``, or is
    the ``rabbitmq`` parameter of a test on both brokers (``broker_url``)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    return ("rabbitmq_url" in getattr(item, "fixturenames", ())
            or any(isinstance(value, str) and value == "rabbitmq" for value in params.values()))


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


#: A failed test's report ends with at most this many last lines of each log
#: its workers wrote (``*.log`` in its ``tmp_path``).
LOG_TAIL = 150


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report shows the end of every worker log it left in its
    ``tmp_path``: the workers' side of the failure, which is gone with the
    temporary directory once CI ends."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or not isinstance(tmp_path, Path):
        return
    for log in sorted(tmp_path.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        report.sections.append((f"{log.relative_to(tmp_path)} (last {LOG_TAIL} lines)",
                                "\n".join(lines[-LOG_TAIL:])))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep a test's fault summary lines and its key prefix; its teardown report
    holds them all. Under xdist this runs in the controller too, with the
    workers' reports."""
    if report.when == "teardown":
        _FAULT_LINES.extend(str(value) for name, value in report.user_properties
                            if name == FAULT_LINE)
        _PREFIXES.update(str(value) for name, value in report.user_properties
                         if name == PREFIX_PROPERTY)
    if report.skipped and "rabbitmq" in report.keywords:
        _SKIPPED_ON_RABBITMQ.append(report.nodeid)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The fault scenarios' summary lines, repeated at the end of the session,
    that the suite had no Redis (once, not only in each skip), and what the
    session's check of the machine's Redis found."""
    no_redis = None if hasattr(config, "workerinput") else suite_redis_unavailable()
    if no_redis is not None:
        terminalreporter.section("no Redis: the tests outside tests/unit were skipped", red=True)
        terminalreporter.write_line(no_redis)
    if _FAULT_LINES and not hasattr(config, "workerinput"):  # not in an xdist worker
        terminalreporter.section("fault scenarios")
        for line in _FAULT_LINES:
            terminalreporter.write_line(line)
    if REQUIRE_RABBITMQ and _SKIPPED_ON_RABBITMQ and not hasattr(config, "workerinput"):
        terminalreporter.section("RabbitMQ tests skipped", red=True)
        terminalreporter.write_line(
            f"{len(_SKIPPED_ON_RABBITMQ)} RabbitMQ test(s) were skipped although "
            "TOOLEFFECT_TEST_REQUIRE_RABBITMQ is set (CI must run them): a failure")
        for nodeid in _SKIPPED_ON_RABBITMQ[:50]:
            terminalreporter.write_line(f"  {nodeid}")
    if _LEAKED_AT_THE_END:
        terminalreporter.section("keys left in a Redis the suite was not given", red=True)
        terminalreporter.write_line(
            f"{len(_LEAKED_AT_THE_END)} key(s) of this session's tests are in the Redis on "
            f"127.0.0.1:6379 (TOOLEFFECT_TEST_REDIS_URL={REDIS_URL}), written after their "
            "test ended (deleted):")
        for line in _LEAKED_AT_THE_END[:50]:
            terminalreporter.write_line(f"  {line}")


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
def aof_redis() -> Iterator[RedisServer]:
    """A redis-server the test owns with AOF (fsync every second), as the docs
    ask of a store: a worker without ``tooleffect_allow_volatile_store``
    starts on it."""
    with redis_server(appendonly=True) as server:
        yield server


@pytest.fixture
def second_redis() -> Iterator[RedisServer]:
    """A second redis-server the test owns and may break (e.g. as the audit store)."""
    with redis_server() as server:
        yield server


#: The RabbitMQ of the RabbitMQ tests; each makes a virtual host of its own there.
RABBITMQ_URL = os.environ.get("TOOLEFFECT_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")
#: The command that manages that RabbitMQ's virtual hosts: the machine's
#: ``rabbitmqctl``, or ``TOOLEFFECT_TEST_RABBITMQCTL`` (``docker exec rabbit rabbitmqctl``).
RABBITMQCTL = shlex.split(os.environ.get("TOOLEFFECT_TEST_RABBITMQCTL") or "rabbitmqctl")
#: Set by CI (.ci/run): a RabbitMQ test that cannot run fails instead of
#: being skipped, so that CI never passes without them.
REQUIRE_RABBITMQ = os.environ.get("TOOLEFFECT_TEST_REQUIRE_RABBITMQ", "") not in ("", "0")
#: Why RabbitMQ tests cannot run in this process ([] before the first asks,
#: [None] when they can): asked once, so that a missing RabbitMQ costs one probe.
_rabbitmq_state: list[str | None] = []


def rabbitmq_unavailable() -> str | None:
    """Why the RabbitMQ tests cannot run here, or None: ``rabbitmqctl`` is
    missing, or nothing answers at :data:`RABBITMQ_URL`'s address."""
    if not _rabbitmq_state:
        parts = url_to_parts(RABBITMQ_URL)
        host, port = parts.hostname or "127.0.0.1", int(parts.port or 5672)
        why: str | None = None
        if shutil.which(RABBITMQCTL[0]) is None:
            why = (f"{RABBITMQCTL[0]} is not installed: each RabbitMQ test makes a virtual "
                   "host of its own with it (TOOLEFFECT_TEST_RABBITMQCTL names another command)")
        else:
            try:
                socket.create_connection((host, port), timeout=3).close()
            except OSError as exc:
                why = (f"no RabbitMQ answers at {host}:{port} ({exc}; "
                       "TOOLEFFECT_TEST_RABBITMQ_URL names another)")
        _rabbitmq_state.append(why)
    return _rabbitmq_state[0]


def no_rabbitmq(why: str) -> NoReturn:
    """Skip the test that needs RabbitMQ, saying why; fail it when
    :data:`REQUIRE_RABBITMQ` (CI)."""
    message = f"RabbitMQ unavailable: {why}"
    if REQUIRE_RABBITMQ:
        pytest.fail(f"{message} (TOOLEFFECT_TEST_REQUIRE_RABBITMQ is set: the RabbitMQ tests "
                    "must run)", pytrace=False)
    pytest.skip(message)


def rabbitmqctl(*arguments: str) -> str | None:
    """Run ``rabbitmqctl -q <arguments>``: None, or why it failed."""
    command = [*RABBITMQCTL, "-q", *arguments]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{shlex.join(command)}: {exc}"
    if done.returncode == 0:
        return None
    said = (done.stderr or done.stdout).strip().splitlines()
    return (f"{shlex.join(command)} failed (exit code {done.returncode}): "
            f"{said[-1] if said else 'no output'}")


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
    message or consumer of another test is ever seen. Without ``rabbitmqctl``
    or a RabbitMQ, the test is skipped, saying why (failed under CI:
    :data:`REQUIRE_RABBITMQ`).
    """
    why = rabbitmq_unavailable()
    if why is not None:
        no_rabbitmq(why)
    user = url_to_parts(RABBITMQ_URL).username or "guest"
    vhost = f"te-{uuid.uuid4().hex[:12]}"
    failed = rabbitmqctl("add_vhost", vhost) or rabbitmqctl(
        "set_permissions", "-p", vhost, user, ".*", ".*", ".*")
    if failed is not None:
        rabbitmqctl("delete_vhost", vhost)
        _rabbitmq_state[:] = [failed]  # the next tests skip without waiting for it again
        no_rabbitmq(failed)
    yield f"{RABBITMQ_URL.rstrip('/')}/{vhost}"
    rabbitmqctl("delete_vhost", vhost)


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards. The
    test fails if a key of it is in a Redis the suite was not given
    (:func:`refuse_keys_on_the_machine_redis`)."""
    value = f"tetest:{uuid.uuid4().hex[:12]}:"
    request.node.user_properties.append((PREFIX_PROPERTY, value))
    yield value
    delete_keys(REDIS_URL, value)
    refuse_keys_on_the_machine_redis(value)


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


def wait_acknowledged(client: redis.Redis, prefix: str) -> None:
    """Wait until the Redis broker under ``prefix`` holds no unacknowledged message.

    A dead letter is stored before its message is rejected (worker/letters.py),
    and :func:`running_worker` stops cold (celery.contrib.testing sets
    ``should_terminate``): a message still unacknowledged then is restored to its
    queue by kombu's channel close and delivered again to the next worker. That
    is at-least-once delivery, not what a test that waits for a letter is about:
    its helpers wait for this too.
    """
    wait_for(lambda: not client.hlen(f"{prefix}unacked"), what="every delivery acknowledged")


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
        # on RabbitMQ the store is named (the suite's Redis, as in ``on_broker``:
        # left unnamed, it would be the package's default, 127.0.0.1:6379) and
        # the journal heartbeat is short.
        broker = broker_url or REDIS_URL
        if not is_redis_family(broker):
            env.setdefault("TE_HEARTBEAT", "0.5")
            store_url = store_url or REDIS_URL
        worker = start_celery_worker(
            "tests.apps.tool_app", tmp_path / f"worker-{len(started)}.log",
            concurrency=concurrency, name=f"w{len(started)}", root=TESTS.parent,
            env=dict(TE_PREFIX=prefix, TE_BROKER=broker, TE_COUNTERS=REDIS_URL,
                     TE_VT=str(visibility_timeout), TE_STORE=store_url or "", **env),
        )
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        worker.kill()
