"""No evicting store: a worker refuses to start on a Redis whose ``maxmemory-policy``
can evict the package's keys, watches evictions while it runs, and Flower's
``/metrics`` exports them.

Every store here is a ``redis-server`` the test starts itself (the main Redis is
the broker, under the test's prefix, and is only read). The workers are real
``celery worker`` subprocesses of a small app written into the test's folder:
its store is the test's server, ``TE_ALLOW`` sets ``tooleffect_allow_eviction``
and ``TE_INTERVAL`` the watch's interval. A worker that refuses to start must
not consume the task sent before it started.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from celery_tooleffect.admin.approvals import Approvals
from celery_tooleffect.admin.flower.metrics import (
    EVICTED_KEYS_GAUGE,
    EVICTING_POLICY_GAUGE,
    export_store_gauges,
)
from celery_tooleffect.store.dead_letters import DeadLetters
from celery_tooleffect.store.runtime import runtime_for
from celery_tooleffect.store.servers import DEAD_LETTERS, JOURNAL, Server
from celery_tooleffect.worker.eviction import (
    OK,
    REFUSE,
    WARN,
    EvictionWatcher,
    eviction_check,
    human_bytes,
    servers,
    verdict,
)
from tests.conftest import (
    RedisServer,
    WorkerProcess,
    redis_server,
    start_celery_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

#: The repository (tests.support is imported by the app below).
ROOT = Path(__file__).resolve().parent.parent

APP = '''
import os

import redis
from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from tests.support import REDIS_URL, app_config
from celery_tooleffect.worker import eviction

PREFIX = os.environ["TE_PREFIX"]
eviction.CHECK_INTERVAL = float(os.environ.get("TE_INTERVAL") or 30)
app = Celery("eviction_app")
app.conf.update(app_config(
    PREFIX, tooleffect_redis_url=os.environ["TE_STORE"],
    tooleffect_allow_eviction=os.environ.get("TE_ALLOW") == "1",
    worker_hijack_root_logger=True,
))
counters = redis.Redis.from_url(REDIS_URL)


@app.task(base=ToolTask, name="eviction.count", effect=ToolEffect.IDEMPOTENT_WRITE)
def count(key: str) -> str:
    counters.incr(f"{PREFIX}count:{key}")
    return key
'''

MB = 1 << 20


def refusal(server: RedisServer, policy: str) -> str:
    return (f"the journal and audit store (127.0.0.1:{server.port}) has maxmemory-policy "
            f"{policy} with maxmemory 50mb: Redis may evict a journal entry and an "
            "interrupted write would run again; set maxmemory-policy noeviction, or "
            "tooleffect_allow_eviction = True to accept the risk")


@pytest.fixture
def spawn(prefix: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``celery -A eviction_app worker`` on ``store``; killed at the end."""
    (tmp_path / "eviction_app.py").write_text(APP)
    started: list[WorkerProcess] = []

    def start(store: RedisServer, *, wait: bool = True, **env: str) -> WorkerProcess:
        worker = start_celery_worker(
            "eviction_app", tmp_path / f"worker-{len(started)}.log", pool="prefork",
            concurrency=1, name="evict", wait=wait, root=tmp_path,
            # The app imports tests.support: the repository is on its path too.
            env={"TE_PREFIX": prefix, "TE_STORE": store.url,
                 "PYTHONPATH": os.pathsep.join((str(tmp_path), str(ROOT))), **env},
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def send(make_app: Callable[..., Celery], store: RedisServer) -> str:
    """Send ``eviction.count`` (to the queue ``tools``); its key."""
    key = uuid.uuid4().hex[:8]
    make_app(tooleffect_redis_url=store.url).send_task("eviction.count", args=[key],
                                                       queue="tools")
    return key


def counted(main_redis: redis.Redis, prefix: str, key: str) -> int:
    return int(main_redis.get(f"{prefix}count:{key}") or 0)


def fill_until_evicted(server: RedisServer, prefix: str) -> int:
    """Give the test's own server a maxmemory just above what it uses, under
    ``allkeys-lru``, and write keys under ``prefix`` until it evicts; its
    ``evicted_keys``."""
    client = server.client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(used + MB))
    value = b"x" * 10_000
    for batch in range(100):
        pipe = client.pipeline(transaction=False)
        for number in range(50):
            pipe.set(f"{prefix}fill:{batch}:{number}", value)
        pipe.execute()
        evicted = int(client.info("stats")["evicted_keys"])
        if evicted:
            return evicted
    raise AssertionError("the server never evicted")


# -- the decision ----------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "maxmemory", "expected"), [
    ("noeviction", 0, OK),
    ("noeviction", 50 * MB, OK),
    ("allkeys-lru", 50 * MB, REFUSE),
    ("allkeys-lfu", 1, REFUSE),
    ("allkeys-random", 50 * MB, REFUSE),
    ("volatile-lru", 50 * MB, REFUSE),   # the package's keys all carry TTLs
    ("volatile-ttl", 50 * MB, REFUSE),
    ("volatile-lfu", 50 * MB, REFUSE),
    ("volatile-random", 50 * MB, REFUSE),
    ("allkeys-lru", 0, WARN),            # evicts as soon as maxmemory is set
    ("volatile-lru", 0, WARN),
])
def test_the_decision(policy: str, maxmemory: int, expected: str) -> None:
    assert verdict(policy, maxmemory) == expected


def test_sizes_are_written_as_redis_writes_them() -> None:
    assert [human_bytes(size) for size in (50 * MB, 100 * MB, 1 << 30, 3 << 10, 1000)] == [
        "50mb", "100mb", "1gb", "3kb", "1000 bytes"]


def test_in_process_check_warns_refuses_and_checks_each_server_once(
    make_app: Callable[..., Celery],
) -> None:
    # The store on the broker's Redis: one server, checked once, for both roles.
    same = servers(runtime_for(make_app()))
    assert [server.roles for server in same] == [[JOURNAL, DEAD_LETTERS]]
    assert eviction_check(runtime_for(make_app())) == ([], [])

    with redis_server("--maxmemory-policy", "allkeys-lru") as evicting, \
            redis_server("--rename-command", "CONFIG", "", "--rename-command", "INFO", "") \
            as unreadable:
        app = make_app(tooleffect_redis_url=evicting.url)
        assert [server.roles for server in servers(runtime_for(app))] == [
            [JOURNAL], [DEAD_LETTERS]]
        refusals, warnings = eviction_check(runtime_for(app))
        assert refusals == []
        assert warnings == [
            f"the journal and audit store (127.0.0.1:{evicting.port}) has maxmemory-policy "
            "allkeys-lru and no maxmemory yet (0): once maxmemory is set, Redis may evict a "
            "journal entry and an interrupted write would run again; set maxmemory-policy "
            "noeviction"]

        evicting.client().config_set("maxmemory", "50mb")
        refusals, warnings = eviction_check(runtime_for(make_app(
            tooleffect_redis_url=evicting.url)))
        assert refusals == [refusal(evicting, "allkeys-lru")] and warnings == []
        refusals, warnings = eviction_check(runtime_for(make_app(
            tooleffect_redis_url=evicting.url, tooleffect_allow_eviction=True)))
        assert refusals == [] and len(warnings) == 1
        assert warnings[0].startswith("EVICTION ALLOWED (tooleffect_allow_eviction = True): "
                                      "the journal and audit store")

        refusals, warnings = eviction_check(runtime_for(make_app(
            tooleffect_redis_url=unreadable.url)))
        assert refusals == [] and len(warnings) == 1
        assert warnings[0].startswith(
            f"could not check whether the journal and audit store (127.0.0.1:"
            f"{unreadable.port}) can evict keys (neither CONFIG GET nor INFO memory answered")


# -- workers ------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "args"), [
    ("allkeys-lru", ()),
    ("volatile-lru", ()),
    # Managed Redis (ElastiCache, Memorystore): CONFIG renamed, INFO memory read instead.
    ("allkeys-lru", ("--rename-command", "CONFIG", "")),
], ids=["allkeys-lru", "volatile-lru", "config-renamed"])
def test_a_worker_on_an_evicting_store_does_not_start(
    make_app: Callable[..., Celery], spawn: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str, policy: str, args: tuple[str, ...],
) -> None:
    with redis_server("--maxmemory", "50mb", "--maxmemory-policy", policy, *args) as store:
        if args:
            with pytest.raises(redis.ResponseError):
                store.client().config_get("maxmemory")
        key = send(make_app, store)
        worker = spawn(store, wait=False)
        wait_for(lambda: worker.process.poll() is not None, timeout=60,
                 what="the worker to refuse to start")
        output = worker.output()
        assert worker.process.returncode != 0, output
        assert "ConfigurationError" in output, output
        assert refusal(store, policy) in output, output
        lines = [line for line in output.splitlines() if refusal(store, policy) in line]
        assert lines, output  # the reason and the fix on one line
        assert " ready." not in output
    # Never consumed: the message is still in the queue, the body never ran.
    assert counted(main_redis, prefix, key) == 0
    assert main_redis.llen(f"{prefix}tools") == 1


def test_a_worker_on_a_noeviction_store_starts(
    make_app: Callable[..., Celery], spawn: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str,
) -> None:
    with redis_server("--maxmemory", "50mb", "--maxmemory-policy", "noeviction") as store:
        key = send(make_app, store)
        worker = spawn(store)
        wait_for(lambda: counted(main_redis, prefix, key) == 1, timeout=30,
                 what="the task to run")
        assert "maxmemory" not in worker.output()


def test_allow_eviction_starts_with_a_loud_warning(
    make_app: Callable[..., Celery], spawn: Callable[..., WorkerProcess],
    main_redis: redis.Redis, prefix: str,
) -> None:
    with redis_server("--maxmemory", "50mb", "--maxmemory-policy", "allkeys-lru") as store:
        key = send(make_app, store)
        worker = spawn(store, TE_ALLOW="1")
        wait_for(lambda: counted(main_redis, prefix, key) == 1, timeout=30,
                 what="the task to run")
        output = worker.output()
        warned = [line for line in output.splitlines() if "EVICTION ALLOWED" in line]
        assert len(warned) == 1, output
        assert "WARNING" in warned[0]
        assert (f"the journal and audit store (127.0.0.1:{store.port}) has maxmemory-policy "
                "allkeys-lru with maxmemory 50mb: Redis may evict a journal entry") in warned[0]


def test_a_running_worker_logs_evictions_once(
    spawn: Callable[..., WorkerProcess], prefix: str,
) -> None:
    with redis_server() as store:
        worker = spawn(store, TE_INTERVAL="0.3")
        assert "maxmemory" not in worker.output()
        time.sleep(1.0)  # a few quiet checks first: nothing evicted, nothing said
        assert "has evicted" not in worker.output()
        evicted = fill_until_evicted(store, prefix)
        pattern = re.compile(
            rf"WARNING.*the journal and audit store \(127\.0\.0\.1:{store.port}\) has "
            r"evicted (\d+) key\(s\) since this worker started \(evicted_keys (\d+)\)")
        found = wait_for(lambda: pattern.findall(worker.output()), timeout=20,
                         what="the eviction warning")
        assert int(found[0][0]) >= evicted and int(found[0][0]) == int(found[0][1])
        fill_until_evicted(store, f"{prefix}more:")  # more evictions, no more warnings
        before = int(store.client().info("stats")["evicted_keys"])
        for _ in range(100):
            store.client().set(f"{prefix}late:{uuid.uuid4().hex}", b"x" * 10_000)
        assert int(store.client().info("stats")["evicted_keys"]) > before
        time.sleep(1.5)
        assert len(pattern.findall(worker.output())) == 1, worker.output()
        assert worker.process.poll() is None


def test_watcher_never_raises_and_rebases_after_a_restart(prefix: str) -> None:
    with redis_server() as store:
        watcher = EvictionWatcher([Server("here", store.client(), [JOURNAL])])
        watcher.check()
        assert watcher.baseline == {"here": 0}
        store.kill()
        watcher.check()  # the store is away: nothing raised, nothing said
        store.start()
        watcher.check()
        assert watcher.baseline == {"here": 0} and not watcher.warned


# -- Flower's /metrics --------------------------------------------------------------------


def test_eviction_gauges(make_app: Callable[..., Celery], main_redis: redis.Redis,
                         prefix: str) -> None:
    registry = CollectorRegistry()

    def served() -> dict[str, dict[str, float]]:
        text = generate_latest(registry).decode()
        return {family.name: {sample.labels["store"]: sample.value
                              for sample in family.samples}
                for family in text_string_to_metric_families(text)
                if family.name in (EVICTED_KEYS_GAUGE, EVICTING_POLICY_GAUGE)}

    with redis_server() as store:
        app = make_app(tooleffect_redis_url=store.url)
        export_store_gauges(Approvals(app), DeadLetters(app), registry=registry)
        main_evicted = float(main_redis.info("stats")["evicted_keys"])
        assert served() == {EVICTED_KEYS_GAUGE: {JOURNAL: 0.0, DEAD_LETTERS: main_evicted},
                            EVICTING_POLICY_GAUGE: {JOURNAL: 0.0, DEAD_LETTERS: 0.0}}
        fill_until_evicted(store, prefix)
        gauges = served()
        evicted = float(store.client().info("stats")["evicted_keys"])
        assert gauges[EVICTED_KEYS_GAUGE][JOURNAL] == evicted > 0
        assert gauges[EVICTING_POLICY_GAUGE] == {JOURNAL: 1.0, DEAD_LETTERS: 0.0}

        # The store gone: its samples are absent, the dead-letter store's served.
        store.kill()
        gauges = served()
        assert JOURNAL not in gauges[EVICTED_KEYS_GAUGE]
        assert DEAD_LETTERS in gauges[EVICTED_KEYS_GAUGE]

    # Store and dead letters on one server: read once, a sample for each role.
    export_store_gauges(Approvals(make_app()), DeadLetters(make_app()), registry=registry)
    single = served()
    assert set(single[EVICTED_KEYS_GAUGE]) == {JOURNAL, DEAD_LETTERS}
