"""Every Redis command a worker sends for one call, from fetch to acknowledgement.

A real ``celery worker`` (``tests/apps/tool_app.py``, prefork, one process)
on a redis-server of the test's own that is broker, result backend and store
at once. Redis ``MONITOR`` records what the worker sends while one call runs:
the commands between the fetch that takes the message and the fetch (or
``BRPOP``) that finds the queue empty again. What runs inside a script is not
counted (it is one command); kombu's periodic upkeep (restore sweeps, binding
refreshes, pidbox), connection handshakes and what the tools' bodies count
are left out, and so is the test's own polling of the result.

The folds of the atomic fetch (issue "Nothing lost on Redis"), each proven by
the exact commands:

- the fetch records the message as unacknowledged in its own script: one
  ``EVALSHA`` where kombu sends ``BRPOP`` and then ``ZADD``/``HSET``;
- a read's audit event stores Celery's result and acknowledges the message in
  one script; a write's outcome does both with its journal transition; the
  worker's main process then sends no acknowledgement (no ``ZREM``/``HDEL``);
- with kombu's own fetch (``tooleffect_atomic_fetch=False``) the
  acknowledgement still rides with the outcome;
- with the store on another Redis, the main process acknowledges as kombu does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_tooleffect.store.lua import script
from celery_tooleffect.testing import (
    RedisServer,
    redis_server,
    start_celery_worker,
    wait_for,
)
from tests.support import Monitor, app_config

ROOT = Path(__file__).resolve().parent.parent
HANDSHAKE = {"HELLO", "CLIENT", "PING", "AUTH", "SELECT", "MONITOR", "ECHO", "INFO"}
#: kombu's upkeep (restore sweeps, queue bindings, pidbox) and what the test
#: tools' bodies count (tests/apps/tool_app.py).
UPKEEP = ("unacked_mutex", "_kombu.binding", "pidbox", "binding_deadlines", ":count:",
          ":started:")
SCRIPTS = ("fetch", "append_event", "begin_attempt", "transition", "extend_lease")


def counted(monitor: Monitor) -> list[list[str]]:
    """The commands of the calls the test counts: what clients sent, without
    connection handshakes, kombu's upkeep and the test tools' counters."""
    out = []
    for words in monitor.sent():
        if words[0].upper() in HANDSHAKE:
            continue
        if any(mark in word for word in words[1:3] for mark in UPKEEP):
            continue
        if words[0].upper() in ("ZRANGE", "SET", "GET", "DEL") and len(words) > 1 and (
                words[1].endswith(("unacked_index", "unacked_mutex"))):
            continue
        out.append(words)
    return out


def named(words: list[str]) -> str:
    """A command as the test names it: ``EVALSHA`` by its script, else its name."""
    name = words[0].upper()
    if name == "EVALSHA":
        for script_name in SCRIPTS:
            if words[1] == script(script_name).sha:
                return script_name
        return f"EVALSHA {words[1][:8]}"
    return name


def fetches(words: list[str]) -> bool:
    return named(words) in ("fetch", "BRPOP")


@dataclass
class Setup:
    server: RedisServer
    prefix: str
    app: Celery
    poller: redis.Redis


@pytest.fixture
def setup() -> Iterator[Setup]:
    with redis_server() as server:
        prefix = f"rt{uuid.uuid4().hex[:8]}:"
        app = Celery("round-trips", set_as_current=False)
        app.conf.update(app_config(
            prefix, broker_url=server.url, result_backend=server.url,
            broker_transport_options={"global_keyprefix": prefix},
            result_backend_transport_options={"global_keyprefix": prefix}))
        poller = redis.Redis.from_url(server.url, single_connection_client=True)
        yield Setup(server, prefix, app, poller)


def call_commands(setup: Setup, tmp_path: Path, name: str, *, fetch: str = "atomic",
                  store: str | None = None, results: str | None = None,
                  monitored: list[Monitor] | None = None) -> list[str]:
    """The commands a worker sends for one successful call of ``name`` (after a
    warm-up call), from its fetch to its acknowledgement. ``results``: the
    result backend's URL when it is not the broker's; ``monitored`` receives
    the MONITOR of the call."""
    env = {"TE_PREFIX": setup.prefix, "TE_BROKER": setup.server.url,
           "TE_COUNTERS": setup.server.url, "TOOLEFFECT_TEST_FETCH": fetch,
           **({"TE_STORE": store} if store else {}),
           **({"TE_RESULTS": results} if results else {})}
    poller = (redis.Redis.from_url(results, single_connection_client=True) if results
              else setup.poller)
    worker = start_celery_worker("tests.apps.tool_app", tmp_path / "worker.log", env=env,
                                 root=ROOT)
    try:
        call(setup, name, poller)  # warm-up: connections, scripts loaded, queue declared
        with Monitor(setup.server.client()) as monitor:
            monitor.ignored.add(str(poller.client_info()["addr"]))
            monitor.ignored.add(str(setup.poller.client_info()["addr"]))
            wait_for(lambda: idle(monitor), timeout=10, what="the worker to wait for work")
            before = len(counted(monitor))
            call(setup, name, poller)
            # Until the worker fetches again after the call: its commands are complete.
            wait_for(lambda: sum(map(fetches, counted(monitor)[before:])) >= 2, timeout=10,
                     what=f"the worker to fetch again: {counted(monitor)[before:]}")
        sent = counted(monitor)[before:]
        if monitored is not None:
            monitored.append(monitor)
    finally:
        worker.stop()
    published = [i for i, words in enumerate(sent) if named(words) == "LPUSH"]
    assert len(published) == 1, sent
    # The test's publish, then the worker's commands, less its idle waits (the
    # BLMOVE that woke for this call was sent before it, as kombu's BRPOP).
    sent = [words for words in sent[published[0] + 1:] if named(words) != "BLMOVE"]
    end = next(i for i, words in enumerate(sent) if i > 0 and fetches(words))
    if fetch == "kombu":
        # The BRPOP that took the message was sent before the call (it blocks).
        return ["BRPOP", *[named(words) for words in sent[:end]]]
    return [named(words) for words in sent[:end]]


def idle(monitor: Monitor) -> bool:
    """The worker has sent its blocking wait (BLMOVE, or kombu's BRPOP)."""
    return any(words[0].upper() in ("BLMOVE", "BRPOP") for words in counted(monitor))


def call(setup: Setup, name: str, poller: redis.Redis | None = None) -> None:
    """Send one call of ``name``; wait for its result (on ``poller``: the
    result backend's database, the broker's by default)."""
    poller = poller or setup.poller
    result = setup.app.send_task(name, args=[uuid.uuid4().hex[:8], 0.0], queue="tools")
    key = f"{setup.prefix}celery-task-meta-{result.id}"
    wait_for(lambda: b'"SUCCESS"' in (poller.get(key) or b""), timeout=20,
             what=f"{name} to succeed")


ACK = ["MULTI", "ZREM", "HDEL", "EXEC"]
KOMBU_APPEND = ["MULTI", "ZADD", "HSET", "EXEC"]
#: Celery's Redis backend: the GET of the current state, then SETEX (the
#: result expires) and PUBLISH in a transaction.
CELERY_RESULT = ["GET", "MULTI", "SETEX", "PUBLISH", "EXEC"]


@pytest.mark.parametrize(("name", "expected"), [
    # A read: the fetch; its audit event with Celery's result and the
    # acknowledgement, and the event's copy to the global stream (pipelined).
    ("tools.read", ["fetch", "append_event", "XADD"]),
    # A write: the fetch; the intent; the outcome with the result and the
    # acknowledgement, and both events' global copies (pipelined).
    ("tools.idempotent", ["fetch", "begin_attempt", "transition", "XADD", "XADD"]),
    ("tools.write", ["fetch", "begin_attempt", "transition", "XADD", "XADD"]),
    # A deadline's broker lease rides in the intent's script.
    ("tools.write_deadline", ["fetch", "begin_attempt", "transition", "XADD", "XADD"]),
    # Plain Celery on the atomic fetch: Celery's result store and kombu's ack.
    ("tools.plain", ["fetch", *CELERY_RESULT, *ACK]),
])
def test_one_call_sends_exactly_these_commands_with_the_atomic_fetch(
    setup: Setup, tmp_path: Path, name: str, expected: list[str],
) -> None:
    assert call_commands(setup, tmp_path, name) == expected


@pytest.mark.parametrize(("name", "expected"), [
    # kombu's fetch: BRPOP, then QoS.append; the ack still rides with the outcome.
    ("tools.read", ["BRPOP", *KOMBU_APPEND, "append_event", "XADD"]),
    ("tools.write", ["BRPOP", *KOMBU_APPEND, "begin_attempt", "transition", "XADD", "XADD"]),
    # What plain Celery sends today: five round trips.
    ("tools.plain", ["BRPOP", *KOMBU_APPEND, *CELERY_RESULT, *ACK]),
])
def test_kombus_own_fetch_sends_brpop_then_records_the_message(
    setup: Setup, tmp_path: Path, name: str, expected: list[str],
) -> None:
    assert call_commands(setup, tmp_path, name, fetch="kombu") == expected


def test_with_the_store_on_another_redis_the_main_process_acknowledges(
    setup: Setup, tmp_path: Path,
) -> None:
    with redis_server() as store:
        # On the broker: the fetch, Celery's own result store (the backend is
        # the broker's Redis, not the store's) and kombu's acknowledgement.
        assert call_commands(setup, tmp_path, "tools.write", store=store.url) == [
            "fetch", *CELERY_RESULT, *ACK]


def in_database(monitor: Monitor, names: tuple[str, ...]) -> dict[str, set[int]]:
    """In which databases the commands ``names`` ran: what clients sent, and
    what scripts ran (MONITOR reports those as the ``lua`` client, in the
    database the script selected)."""
    where: dict[str, set[int]] = {}
    for command in monitor.received:
        words = command["command"].split(" ")
        name = named(words) if command.get("client_type") != "lua" else words[0].upper()
        if name in names and not any(mark in word for word in words[1:3] for mark in UPKEEP):
            where.setdefault(name, set()).add(int(command["db"]))
    return where


@pytest.mark.parametrize(("name", "expected", "script_name"), [
    ("tools.read", ["fetch", "append_event", "XADD"], "append_event"),
    ("tools.idempotent", ["fetch", "begin_attempt", "transition", "XADD", "XADD"],
     "transition"),
    ("tools.write", ["fetch", "begin_attempt", "transition", "XADD", "XADD"], "transition"),
    # The deadline's broker lease rides in the intent's script, which selects
    # the broker's database for it.
    ("tools.write_deadline", ["fetch", "begin_attempt", "transition", "XADD", "XADD"],
     "transition"),
])
def test_one_server_several_databases_still_folds_the_result_and_the_ack(
    setup: Setup, tmp_path: Path, name: str, expected: list[str], script_name: str,
) -> None:
    """Celery's documented pattern: the broker in database 0, results and store
    in database 1 of the same server. The outcome's script (run in database 1)
    selects database 1 for Celery's result and database 0 for the
    acknowledgement (a script's SELECT is its own); the worker's main process
    sends no ZREM/HDEL and Celery no result of its own."""
    results = setup.server.url[:-1] + "1"
    monitored: list[Monitor] = []
    assert call_commands(setup, tmp_path, name, results=results, store=results,
                         monitored=monitored) == expected
    where = in_database(monitored[0], ("fetch", script_name, "ZREM", "HDEL", "SET",
                                       "PUBLISH", "SETEX", "XADD"))
    # The fetch in the broker's database, the outcome script in the store's;
    # inside it, the result in the backend's and the acknowledgement in the
    # broker's.
    assert where["fetch"] == {0}
    assert where[script_name] == {1}
    assert where["ZREM"] == where["HDEL"] == {0}
    assert where["SET"] == where["PUBLISH"] == {1}
    assert "SETEX" not in where
    # The global copies pipelined after the script on its connection (and the
    # run's events inside it) went to the store's database: the script's
    # SELECTs left the connection where it was.
    assert where["XADD"] == {1}
    # A deadline's lease: raised by the intent's script (ZADD XX GT) in kombu's
    # unacked index, in the broker's database.
    leases = {int(command["db"]) for command in monitored[0].received
              if command.get("client_type") == "lua"
              and command["command"].split(" ")[0].upper() == "ZADD"
              and command["command"].split(" ")[2:4] == ["XX", "GT"]}
    assert leases == ({0} if name == "tools.write_deadline" else set())


def test_one_server_several_databases_plain_celery_is_unchanged(
    setup: Setup, tmp_path: Path,
) -> None:
    results = setup.server.url[:-1] + "1"
    assert call_commands(setup, tmp_path, "tools.plain", results=results, store=results) == [
        "fetch", *CELERY_RESULT, *ACK]


#: The commands that end a call on a threads pool: the script that records the
#: outcome and acknowledges the message (folded), or kombu's own ZREM.
ENDINGS = {"tools.read": "append_event", "tools.write": "transition", "tools.plain": "ZREM"}


@pytest.mark.parametrize("name", sorted(ENDINGS))
def test_on_the_threads_pool_the_next_fetch_follows_an_acknowledgement(
    setup: Setup, tmp_path: Path, name: str,
) -> None:
    """A threads pool's thread acknowledges a tool's message in the outcome's
    script; kombu's bookkeeping of it runs in the event loop, which it wakes to
    fetch at once. Without the wake-up the loop sleeps until its next timer,
    kombu's restore sweep (every second in tests/apps/tool_app.py), and fetches
    after it: the sweep is the clock this test counts by, never time."""
    env = {"TE_PREFIX": setup.prefix, "TE_BROKER": setup.server.url,
           "TE_COUNTERS": setup.server.url}
    concurrency, calls = 2, 30
    worker = start_celery_worker("tests.apps.tool_app", tmp_path / "worker.log", env=env,
                                 root=ROOT, pool="threads", concurrency=concurrency)
    try:
        call(setup, name)  # warm-up: connections, scripts loaded, queue declared
        with Monitor(setup.server.client()) as monitor:
            monitor.ignored.add(str(setup.poller.client_info()["addr"]))
            keys = [uuid.uuid4().hex[:8] for _ in range(calls)]
            ids = [setup.app.send_task(name, args=[key, 0.0], queue="tools").id
                   for key in keys]
            metas = [f"{setup.prefix}celery-task-meta-{task_id}" for task_id in ids]

            def succeeded() -> bool:
                return all(b'"SUCCESS"' in (setup.poller.get(meta) or b"") for meta in metas)

            wait_for(succeeded, timeout=60, what=f"the {calls} calls of {name} to succeed")
        sent = monitor.sent()
    finally:
        worker.stop()
    # Each body ran once.
    assert [setup.poller.get(f"{setup.prefix}count:{key}") for key in keys] == [b"1"] * calls
    # For each fetch after an acknowledgement: did a restore sweep come between?
    waited, swept, sweep_between = 0, 0, False
    after_ending = False
    for words in sent:
        if named(words) == ENDINGS[name]:
            after_ending = True
        elif words[0].upper() == "SET" and words[1].endswith("unacked_mutex"):
            sweep_between = sweep_between or after_ending
        elif fetches(words) and after_ending:
            waited += 1
            swept += sweep_between
            after_ending = sweep_between = False
    # About one fetch a batch of `concurrency` calls (more when calls end apart).
    assert waited >= calls // concurrency - 1, sent
    # A sweep may happen to fall between an acknowledgement and its fetch; a
    # loop that is not woken waits for one before every fetch.
    assert swept <= 2, (waited, swept)
