"""The atomic fetch on Redis (celery_tooleffect/worker/transport*.py, fetch.lua),
with real processes: a redis-server of each test's own (or of this module's,
for the ``celery worker``), kombu connections and a real worker.

Where kombu's own transport sets the standard (delivery order, the record in
``unacked``, what a consumer receives), the same scenario runs through kombu's
``Transport`` and through the package's, and the outcomes are compared.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic, sleep, time
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Exchange, Message, Producer, Queue
from kombu.transport import redis as kombu_redis

from celery_tooleffect import ToolTask
from celery_tooleffect.store.dead_letter_record import DeadLetter
from celery_tooleffect.store.dead_letters import DeadLetterReason, DeadLetters
from celery_tooleffect.store.lua import script
from celery_tooleffect.testing import (
    RedisServer,
    WorkerProcess,
    redis_server,
    start_celery_worker,
    wait_for,
)
from celery_tooleffect.worker.fetch import uses_atomic_fetch
from celery_tooleffect.worker.transport import AtomicFetch, SentinelTransport, Transport
from celery_tooleffect.worker.transport_unreadable import UNREADABLE
from celery_tooleffect.worker.transport_waits import REFUSED_RETRY
from tests.support import Monitor, TcpProxy, app_config
from tests.topologies import MASTER, sentinel_set

TESTS = Path(__file__).parent
FETCH_SHA = script("fetch").sha

# -- kombu connections, publishing, consuming ---------------------------------------


def connect(url: str, atomic: bool = True, transport: type | None = None,
            **options: Any) -> Connection:
    """A kombu connection with the atomic fetch, or with kombu's own (``atomic=False``)."""
    if transport is None:
        transport = Transport if atomic else kombu_redis.Transport
    return Connection(url, transport=transport, transport_options=options)


def queue(name: str, **options: Any) -> Queue:
    return Queue(name, Exchange(name), routing_key=name, **options)


def publish(url: str, messages: list[tuple[str, Any, dict[str, Any]]],
            **options: Any) -> None:
    """Publish ``(queue, body, publish options)`` with plain kombu (its own
    transport), to the default exchange: straight onto the queue's list."""
    with connect(url, atomic=False, **options) as connection:
        producer = Producer(connection.default_channel)
        for name, body, publish_options in messages:
            producer.publish(body, exchange="", routing_key=name, retry=False,
                             **publish_options)


def drain_until(connection: Connection, done: Callable[[], bool], timeout: float = 10.0,
                what: str = "the messages") -> None:
    """``drain_events()`` until ``done()``; AssertionError after ``timeout`` seconds."""
    deadline = monotonic() + timeout
    while not done():
        left = deadline - monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout}s draining {what}")
        with suppress(socket.timeout):
            connection.drain_events(timeout=min(left, 1.0))


def idle(connection: Connection, seconds: float = 0.5) -> None:
    """One drain_events() that times out: the consumer has fetched, found
    nothing and armed its waits."""
    with pytest.raises(socket.timeout):
        connection.drain_events(timeout=seconds)


def consume(connection: Connection, names: list[str], count: int, *, ack: bool = True,
            no_ack: bool = False, timeout: float = 10.0) -> list[Message]:
    """Receive ``count`` messages from ``names`` on one channel (acknowledged
    as they come unless ``ack`` is false)."""
    got: list[Message] = []

    def on_message(message: Message) -> None:
        got.append(message)
        if ack and not no_ack:
            message.ack()

    with Consumer(connection.channel(), [queue(name) for name in names],
                  on_message=on_message, no_ack=no_ack):
        drain_until(connection, lambda: len(got) >= count, timeout)
    return got


def atomic_channel(consumer: Consumer) -> AtomicFetch:
    channel = consumer.channel
    assert isinstance(channel, AtomicFetch)
    return channel


def received(message: Message) -> dict[str, Any]:
    """Everything a consumer sees of a message."""
    return {"body": message.body, "decoded": message.decode(), "headers": message.headers,
            "properties": message.properties, "content_type": message.content_type,
            "content_encoding": message.content_encoding,
            "delivery_info": message.delivery_info, "delivery_tag": message.delivery_tag}


# -- Redis: the broker's keys, MONITOR -----------------------------------------------


@dataclass
class Broker:
    """kombu's keys on one server, under ``prefix`` (``global_keyprefix``)."""

    client: Any  # redis.Redis (bytes replies)
    prefix: str = ""

    def queued(self, name: str) -> list[bytes]:
        """The items of a queue's list, the next one to be fetched first."""
        return list(reversed(self.client.lrange(f"{self.prefix}{name}", 0, -1)))

    def records(self) -> dict[str, Any]:
        """kombu's ``unacked`` hash: delivery tag -> [payload, exchange, routing key]."""
        return {tag.decode(): json.loads(record)
                for tag, record in self.client.hgetall(f"{self.prefix}unacked").items()}

    def index(self) -> dict[str, float]:
        """kombu's ``unacked_index``: delivery tag -> when it was delivered."""
        return {tag.decode(): float(score) for tag, score in
                self.client.zrange(f"{self.prefix}unacked_index", 0, -1, withscores=True)}

    def empty(self, *names: str) -> bool:
        return (not self.records() and not self.index()
                and not any(self.queued(name) for name in names))


def restore_visible(url: str, **options: Any) -> None:
    """kombu's restore of unacknowledged messages past their visibility
    timeout, as a worker's timer runs it (a scan on every call here)."""
    with connect(url, atomic=False, **options) as connection:
        connection.default_channel.qos.restore_visible(num=100, interval=1)


def fetches(monitor: Monitor) -> list[list[str]]:
    """The atomic fetches clients sent while ``monitor`` was open."""
    return [words for words in monitor.named("EVALSHA") if words[1] == FETCH_SHA]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as started:
        yield started


@pytest.fixture
def broker(server: RedisServer) -> Broker:
    return Broker(server.client())


# -- 1. order ----------------------------------------------------------------------

#: Three queues, each with messages of every priority step, in no order.
ORDER_MESSAGES = [(name, f"{name}{n}", {"priority": priority})
                  for name in ("alpha", "beta", "gamma")
                  for n, priority in enumerate([9, 0, 5, 3, 0, 7, 2, 9, 6])]


def delivery_order(server: RedisServer, atomic: bool, names: list[str],
                   messages: list[tuple[str, Any, dict[str, Any]]],
                   **options: Any) -> list[tuple[str, Any]]:
    """Queue ``messages``, then consume ``names`` on one channel: (queue, body)
    in the order they were delivered."""
    broker = Broker(server.client(), options.get("global_keyprefix", ""))
    # Each run leaves the queues as it found them (asserted below): nothing to clear.
    assert broker.empty(*names)
    publish(server.url, messages, **options)
    with connect(server.url, atomic, **options) as connection:
        got = consume(connection, names, len(messages))
    assert broker.empty(*names)
    return [(message.delivery_info["routing_key"], message.payload) for message in got]


@pytest.mark.parametrize("strategy", ["round_robin", "priority", "sorted"])
def test_queues_and_priorities_are_fetched_in_kombus_order(
    server: RedisServer, strategy: str,
) -> None:
    names = ["gamma", "alpha", "beta"]  # neither sorted nor the order published
    kombu = delivery_order(server, False, names, ORDER_MESSAGES, queue_order_strategy=strategy)
    ours = delivery_order(server, True, names, ORDER_MESSAGES, queue_order_strategy=strategy)
    assert ours == kombu
    # Not vacuous: priorities 0-2 (kombu's lowest step, its first key) first,
    # and the strategies differ where kombu's do.
    assert {body[-1] for _, body in ours[:9]} == {"1", "4", "6"}
    assert [name for name, _ in ours[:3]] == {"round_robin": ["gamma", "alpha", "beta"],
                                              "priority": ["gamma", "gamma", "gamma"],
                                              "sorted": ["alpha", "alpha", "alpha"]}[strategy]


@pytest.mark.parametrize("options", [
    {"global_keyprefix": "tenant:"},
    {"sep": ":"},
    {"priority_steps": [0, 5]},
    {"global_keyprefix": "t{1}/", "sep": "|", "priority_steps": [0, 2, 4, 6, 8, 10]},
], ids=["global_keyprefix", "sep", "priority_steps", "all-three"])
def test_key_options_are_honoured_as_kombu_honours_them(
    server: RedisServer, options: dict[str, Any],
) -> None:
    names = ["alpha", "beta", "gamma"]
    kombu = delivery_order(server, False, names, ORDER_MESSAGES, **options)
    ours = delivery_order(server, True, names, ORDER_MESSAGES, **options)
    assert ours == kombu
    # The keys the options name are the ones filled (and then emptied).
    publish(server.url, ORDER_MESSAGES, **options)
    sep: str = options.get("sep", kombu_redis.Channel.sep)
    steps: list[int] = options.get("priority_steps", kombu_redis.PRIORITY_STEPS)
    prefix: str = options.get("global_keyprefix", "")
    client: Any = server.client()

    def list_key(name: str, priority: int) -> str:
        step = max(step for step in steps if step <= priority)
        return prefix + (f"{name}{sep}{step}" if step else name)

    expected = {list_key(name, publish_options["priority"])
                for name, _, publish_options in ORDER_MESSAGES}
    assert {key.decode() for key in client.keys("*")} >= expected
    with connect(server.url, **options) as connection:
        consume(connection, names, len(ORDER_MESSAGES))
    assert not {key.decode() for key in client.keys("*")} & expected


# -- 2. the record in unacked --------------------------------------------------------


def test_a_held_message_is_recorded_as_kombus_qos_append_records_it(
    server: RedisServer, broker: Broker,
) -> None:
    publish(server.url, [("tools", {"call": 1}, {"headers": {"x-trace": "t1"}})])
    [item] = broker.queued("tools")

    def hold(atomic: bool) -> tuple[Message, dict[str, Any], dict[str, float]]:
        with connect(server.url, atomic) as connection:
            [message] = consume(connection, ["tools"], 1, ack=False)
            records, index = broker.records(), broker.index()
            message.ack()
        return message, records, index

    kombu_message, kombu_records, _ = hold(atomic=False)
    server.client().rpush("tools", item)  # the same item again: the same delivery tag
    started = time()
    message, records, index = hold(atomic=True)

    tag = message.delivery_tag
    assert tag == json.loads(item)["properties"]["delivery_tag"]
    assert records == kombu_records == {tag: [json.loads(item), "", "tools"]}
    assert list(index) == [tag]
    assert started - 1 <= index[tag] <= time() + 1
    assert received(message) == received(kombu_message)
    assert broker.empty("tools")  # the acknowledgement removed both


def test_kombus_restore_puts_a_held_message_back(server: RedisServer, broker: Broker) -> None:
    publish(server.url, [("tools", {"call": 2}, {})])
    with connect(server.url) as connection:
        [held] = consume(connection, ["tools"], 1, ack=False)
        assert list(broker.records()) == [held.delivery_tag]
        assert not broker.queued("tools")

        def restored() -> bool:
            restore_visible(server.url, visibility_timeout=1)
            return bool(broker.queued("tools"))

        wait_for(restored, timeout=10, what="kombu's restore")
        assert not broker.records() and not broker.index()
    with connect(server.url) as connection:
        [again] = consume(connection, ["tools"], 1)
    assert again.delivery_tag == held.delivery_tag and again.payload == {"call": 2}
    assert again.delivery_info["redelivered"] is True
    assert broker.empty("tools")


# -- 3. blocking without polling -------------------------------------------------------


def test_an_idle_consumer_sends_nothing_but_its_waits(server: RedisServer) -> None:
    with connect(server.url) as connection, Consumer(
        connection.channel(), [queue("tools")], on_message=lambda message: None,
    ):
        idle(connection)
        with Monitor(server.client()) as monitor, pytest.raises(socket.timeout):
            connection.drain_events(timeout=5)
    assert fetches(monitor) == []
    waits = monitor.named("BLMOVE")
    lists = {"tools", *(f"tools\\x06\\x16{step}" for step in (3, 6, 9))}  # as MONITOR shows
    assert {words[1] for words in waits} <= lists
    # One wait per list, each renewed when its timeout ends: kombu's
    # brpop_timeout (1 s) times the 4 lists, so that the worker sends one
    # command a second, as kombu's one BRPOP over the 4 lists does. In 5 s:
    # one or two renewals of each.
    assert {words[-1] for words in waits} == {"4"}
    assert 4 <= len(waits) <= 4 * 2
    # The rest is kombu's restore sweep (lock, scan, unlock), every 10th poll,
    # and the handshake of a connection opened meanwhile.
    others = {words[0].upper() for words in monitor.sent()} - {"BLMOVE"}
    assert others <= {"SET", "ZRANGE", "EVALSHA", "HELLO"}, monitor.sent()


def test_waiting_messages_are_fetched_one_script_call_each_without_waits(
    server: RedisServer, broker: Broker,
) -> None:
    publish(server.url, [("tools", n, {"priority": n % 10}) for n in range(20)])
    server.client().script_load(script("fetch").text)  # no NOSCRIPT round trip first
    with connect(server.url) as connection, Monitor(server.client()) as monitor:
        got = consume(connection, ["tools"], 20)
    assert sorted(message.payload for message in got) == list(range(20))
    # One round trip per message, and nothing else fetches: no BRPOP, no
    # RPOP, no wait while a list holds a message.
    assert len(fetches(monitor)) == 20
    assert not monitor.named("BLMOVE") and not monitor.named("BRPOP")
    assert not monitor.named("RPOP") and not monitor.named("HSET")
    assert broker.empty("tools")


@pytest.mark.parametrize("options", [{}, {"polling_interval": 30}],
                         ids=["default", "polling_interval"])
def test_an_idle_consumer_wakes_at_once_for_a_plain_kombu_message(
    server: RedisServer, options: dict[str, Any],
) -> None:
    got: list[tuple[Message, float]] = []
    with connect(server.url, **options) as connection, Consumer(
        connection.channel(), [queue("tools")],
        on_message=lambda message: got.append((message, monotonic())),
    ) as consumer:
        # Waits that would time out only after 30 s: a delivery sooner is a
        # wake-up. (kombu's drain_events() sleeps polling_interval after a
        # round without delivery, which a wake-up is not allowed to be.)
        atomic_channel(consumer).brpop_timeout = 30
        idle(connection)
        published: list[float] = []

        def send() -> None:
            published.append(monotonic())
            publish(server.url, [("tools", "wake", {})])

        producer = threading.Thread(target=send)
        producer.start()
        connection.drain_events(timeout=10)
        producer.join()
    [(message, at)] = got
    assert message.payload == "wake"
    assert at - published[0] < 1.0


# -- 4. interop ------------------------------------------------------------------------

#: Messages as a plain kombu producer sends them: serializers, compression,
#: raw bytes, headers and properties.
PLAIN_MESSAGES: list[tuple[str, Any, dict[str, Any]]] = [
    ("tools", {"args": [1, "two", None], "when": "2026-01-01"},
     {"headers": {"x-trace": "abc", "nested": {"n": [1, 2]}}, "correlation_id": "c-1",
      "reply_to": "replies", "expiration": 60}),
    ("tools", b"\x00\xffraw bytes\x80", {"content_type": "application/data",
                                         "content_encoding": "binary"}),
    ("tools", "unicode: \u00e9\u4e2d\U0001f600", {"serializer": "json"}),
    ("tools", {"big": "x" * 100_000}, {"compression": "zlib"}),
    ("tools", {"n": 1}, {"headers": {"h": 1.5, "empty": {}, "none": None}}),
]


def test_plain_kombu_messages_are_received_unchanged(server: RedisServer,
                                                     broker: Broker) -> None:
    publish(server.url, PLAIN_MESSAGES)
    items = broker.queued("tools")

    def receive(atomic: bool) -> list[dict[str, Any]]:
        server.client().delete("tools")
        server.client().lpush("tools", *items)
        with connect(server.url, atomic) as connection:
            got = consume(connection, ["tools"], len(items))
        return [received(message) for message in got]

    kombu = receive(atomic=False)
    assert receive(atomic=True) == kombu
    assert [message["decoded"] for message in kombu] == [body for _, body, _ in PLAIN_MESSAGES]
    assert broker.empty("tools")


def test_a_20_mib_message_is_fetched_whole(server: RedisServer, broker: Broker) -> None:
    body = os.urandom(20 * 2**20)
    publish(server.url, [("tools", body, {"content_type": "application/data",
                                          "content_encoding": "binary"})])
    [item] = broker.queued("tools")
    with connect(server.url) as connection:
        [message] = consume(connection, ["tools"], 1, ack=False, timeout=30)
        assert message.body == body
        assert broker.records() == {message.delivery_tag: [json.loads(item), "", "tools"]}
        message.ack()
    assert broker.empty("tools")


def test_a_kombu_consumer_and_an_atomic_one_share_a_queue_exactly_once(
    server: RedisServer, broker: Broker,
) -> None:
    total = 300
    got: dict[bool, list[int]] = {False: [], True: []}
    ready = threading.Barrier(3)
    done = threading.Event()

    def run(atomic: bool) -> None:
        def on_message(message: Message) -> None:
            got[atomic].append(message.payload)
            message.ack()
            if len(got[False]) + len(got[True]) >= total:
                done.set()

        with connect(server.url, atomic) as connection, Consumer(
            connection.channel(), [queue("tools")], on_message=on_message, prefetch_count=1,
        ):
            with suppress(socket.timeout):
                connection.drain_events(timeout=0.2)
            ready.wait(10)
            while not done.is_set():
                with suppress(socket.timeout):
                    connection.drain_events(timeout=0.2)

    threads = [threading.Thread(target=run, args=(atomic,)) for atomic in (False, True)]
    for thread in threads:
        thread.start()
    ready.wait(10)
    publish(server.url, [("tools", n, {}) for n in range(total)])
    wait_for(done.is_set, timeout=30, what="every message to be delivered")
    for thread in threads:
        thread.join(10)
    assert sorted(got[False] + got[True]) == list(range(total))  # each once
    assert got[False] and got[True]
    assert broker.empty("tools")


def test_an_app_with_a_tool_fetches_atomically_unless_told_not_to() -> None:
    def app(**settings: Any) -> Celery:
        made = Celery(f"fetch-{uuid.uuid4().hex[:6]}", set_as_current=False)
        made.conf.update(app_config("fetch-app:", **{"broker_url": "redis://127.0.0.1:1/0",
                                                     **settings}))

        @made.task(base=ToolTask, name="fetch.tool", shared=False)
        def tool() -> None:
            """Binding a ToolTask installs the fetch."""

        made.finalize()
        return made

    assert uses_atomic_fetch(app(tooleffect_atomic_fetch=True).connection_for_read())
    assert not uses_atomic_fetch(app(tooleffect_atomic_fetch=False).connection_for_read())
    sentinel = app(tooleffect_atomic_fetch=True,
                   broker_url="sentinel://127.0.0.1:1;sentinel://127.0.0.1:2")
    assert sentinel.connection_for_read().get_transport_cls() is SentinelTransport


# -- a real worker of tests/apps/tool_app.py on a redis-server of this module -------

PREFIX = "fetch:"


@dataclass
class ToolWorker:
    """``celery -A tests.apps.tool_app worker`` on a private server (broker,
    results, store), with the atomic fetch, and an app to send it calls."""

    server: RedisServer
    worker: WorkerProcess
    app: Celery
    broker: Broker = field(init=False)

    def __post_init__(self) -> None:
        self.broker = Broker(self.server.client(socket_timeout=60), PREFIX)

    def call(self, key: str | None = None) -> str:
        """A normal call, run to its end."""
        key = key or uuid.uuid4().hex
        return str(self.app.send_task("tools.read", args=[key]).get(timeout=30))

    def dead_letter_of(self, body: bytes) -> DeadLetter:
        letters = DeadLetters(self.app)

        def stored() -> DeadLetter | None:
            return next((letter for letter in letters.list("tools", limit=5)
                         if letter.message is not None and letter.message.body == body), None)

        found = wait_for(stored, timeout=60, what="the dead letter")
        assert found is not None
        return found


def blocked_waits(server: RedisServer) -> int:
    """How many clients of ``server`` are blocked in a ``BLMOVE`` (a fetch's wait)."""
    return sum(1 for client in server.client().client_list()
               if client.get("cmd") == "blmove" and "b" in client.get("flags", ""))


@pytest.fixture(scope="module")
def tool_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolWorker]:
    with redis_server() as server:
        env = {"TE_PREFIX": PREFIX, "TE_BROKER": server.url, "TE_COUNTERS": server.url,
               "TE_VT": "60", "TOOLEFFECT_TEST_FETCH": "atomic"}
        worker = start_celery_worker(
            "tests.apps.tool_app", tmp_path_factory.mktemp("fetch") / "worker.log",
            name="fetch", root=TESTS.parent, env=env)
        app = Celery("fetch-producer", set_as_current=False)
        app.conf.update(app_config(PREFIX, broker_url=server.url, result_backend=server.url))
        try:
            yield ToolWorker(server, worker, app)
        finally:
            worker.kill()


def test_a_worker_says_it_fetches_atomically(tool_worker: ToolWorker) -> None:
    banner = [line for line in tool_worker.worker.output().splitlines()
              if ".> transport:" in line]
    assert banner and "(atomic fetch)" in banner[0], tool_worker.worker.output()


def test_a_worker_runs_calls_and_answers_broadcasts(tool_worker: ToolWorker) -> None:
    assert [tool_worker.call(f"k{n}") for n in range(5)] == [f"k{n}" for n in range(5)]
    # celery inspect ping: a fanout (pidbox) request, answered on a reply queue
    # that the inspecting app (tool_app: the atomic fetch too) consumes.
    pinged = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.tool_app", "inspect", "ping",
         "-d", tool_worker.worker.name, "--timeout", "10"],
        env=tool_worker.worker.env, cwd=TESTS.parent, capture_output=True, text=True,
        timeout=60, check=False)
    assert pinged.returncode == 0 and "pong" in pinged.stdout, pinged.stdout + pinged.stderr
    # A revoke broadcast reaches the worker: the call revoked before it is sent never runs.
    task_id = uuid.uuid4().hex
    replies = tool_worker.app.control.revoke(task_id, reply=True, limit=1, timeout=10)
    assert [name for reply in replies for name in reply] == [tool_worker.worker.name]
    revoked = tool_worker.app.send_task("tools.read", args=["revoked"], task_id=task_id)
    wait_for(lambda: revoked.state == "REVOKED", timeout=20, what="the call to be revoked")
    assert tool_worker.server.client().get(f"{PREFIX}count:revoked") is None
    wait_for(lambda: tool_worker.broker.empty("tools"), timeout=10,
             what="the revoked call to be acknowledged")


def test_an_idle_worker_sends_no_fetch_and_spins_no_cpu(tool_worker: ToolWorker) -> None:
    tool_worker.call()
    # Idle: the call's message acknowledged, and every wait sent again (the
    # worker fetches once more after a delivery, once its prefetch allows:
    # after its main process learned the call ended, which can be after the
    # result reached this test), so it is blocked on one BLMOVE per list.
    lists = len(kombu_redis.PRIORITY_STEPS)
    wait_for(lambda: tool_worker.broker.empty("tools")
             and blocked_waits(tool_worker.server) == lists, timeout=10, what="an idle worker")
    cpu_before = sum(tool_worker.worker.cpu_seconds())
    with Monitor(tool_worker.server.client()) as monitor:
        sleep(5)  # the window watched, not a wait for something to happen
    cpu = sum(tool_worker.worker.cpu_seconds()) - cpu_before
    assert fetches(monitor) == []
    # Each wait renewed once or twice (every 4 s: see the test above).
    assert lists <= len(monitor.named("BLMOVE")) <= lists * 2
    assert cpu < 1.0
    # ... and it wakes for a call at once.
    started = monotonic()
    tool_worker.call()
    assert monotonic() - started < 5


# -- 5. bad input: dead-lettered with its bytes, never lost, never stopping the worker --


def envelope(**properties: Any) -> dict[str, Any]:
    """A Celery task message (tools.read) as kombu's Redis transport queues it."""
    task_id = uuid.uuid4().hex
    body = json.dumps([["bad"], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                     "chord": None}])
    return {
        "body": base64.b64encode(body.encode()).decode(),
        "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": "tools.read", "id": task_id, "root_id": task_id,
                    "parent_id": None, "group": None, "retries": 0, "eta": None,
                    "expires": None, "argsrepr": "['bad']", "kwargsrepr": "{}"},
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": "tools"},
                       "priority": 0, "body_encoding": "base64",
                       "delivery_tag": uuid.uuid4().hex, **properties},
    }


def without(payload: dict[str, Any], *path: str) -> dict[str, Any]:
    inner = payload
    for name in path[:-1]:
        inner = inner[name]
    del inner[path[-1]]
    return payload


BAD_ITEMS: dict[str, Callable[[], bytes]] = {
    "bytes-not-utf8": lambda: b"\xff\xfe\x00 not json \x80\x81\xc3(",
    "text-not-json": lambda: b"call tools.read please",
    "json-not-an-object": lambda: b'["tools.read", ["k"], {}]',
    "json-null": lambda: b"null",
    "no-properties": lambda: json.dumps(without(envelope(), "properties")).encode(),
    "no-delivery-tag": lambda: json.dumps(
        without(envelope(), "properties", "delivery_tag")).encode(),
    "headers-null": lambda: json.dumps({**envelope(), "headers": None}).encode(),
    "body-not-base64": lambda: json.dumps({**envelope(), "body": "x"}).encode(),
    # cjson (in the script) reads a hex number, Python's json does not.
    "json-only-lua-reads": lambda: json.dumps(envelope()).replace(
        '"retries": 0', '"retries": 0x0').encode(),
    "20-mib-of-garbage": lambda: os.urandom(20 * 2**20),
}


@pytest.mark.parametrize("kind", list(BAD_ITEMS))
def test_an_unreadable_item_is_dead_lettered_with_its_bytes(
    tool_worker: ToolWorker, kind: str,
) -> None:
    item = BAD_ITEMS[kind]()
    tool_worker.broker.client.lpush(f"{PREFIX}tools", item)
    letter = tool_worker.dead_letter_of(item)
    assert letter.reason == DeadLetterReason.UNDECODABLE_MESSAGE.value
    assert letter.message is not None and letter.message.body == item
    assert letter.message.content_type == UNREADABLE
    wait_for(lambda: tool_worker.broker.empty("tools"), timeout=20,
             what="queue and unacked to be empty")
    assert tool_worker.call() and tool_worker.worker.process.poll() is None


@pytest.mark.parametrize("kind", ["bytes-not-utf8", "headers-null", "body-not-base64",
                                  "json-only-lua-reads"])
def test_a_held_unreadable_item_is_restored_by_kombu_with_its_bytes(
    server: RedisServer, broker: Broker, kind: str,
) -> None:
    """What a worker that dies holding an unreadable item leaves in ``unacked``
    is a record kombu's restore can read and put back (it raises on text that
    is not JSON to Python, and drops a message whose headers are no object)."""
    item = BAD_ITEMS[kind]()
    server.client().lpush("tools", item)
    with connect(server.url) as connection:
        [held] = consume(connection, ["tools"], 1, ack=False)
        assert held.content_type == UNREADABLE and held.body == item

        def restored() -> bool:
            restore_visible(server.url, visibility_timeout=1)
            return bool(broker.queued("tools"))

        wait_for(restored, timeout=10, what="kombu's restore")
    with connect(server.url) as connection:
        [again] = consume(connection, ["tools"], 1)
    assert again.content_type == UNREADABLE and again.body == item
    assert again.delivery_tag == held.delivery_tag
    assert broker.empty("tools")


# -- 6. failures: refused, interrupted -------------------------------------------------


def test_a_fetch_refused_for_memory_leaves_the_message_queued_until_memory_is_freed(
    server: RedisServer, broker: Broker,
) -> None:
    got: list[Message] = []
    with connect(server.url) as connection, Consumer(
        connection.channel(), [queue("tools")], on_message=got.append,
    ) as consumer:
        channel = atomic_channel(consumer)
        idle(connection)
        # Waiting on a full server: the waits are refused (BLMOVE is a write),
        # neither raised nor sent again at once.
        server.refuse_writes()
        with Monitor(server.client()) as monitor:
            idle(connection, 3)
        assert len(fetches(monitor)) <= 3 / REFUSED_RETRY + 1
        assert len(monitor.named("BLMOVE")) <= 4 * (3 / REFUSED_RETRY + 1)
        server.accept_writes()
        publish(server.url, [("tools", {"call": 3}, {})])
        [item] = broker.queued("tools")
        server.refuse_writes()
        refused = channel._refused_until
        # drain_events() with no timeout: it must not wait for ever on a
        # refused fetch (nothing is in flight then).
        drained = threading.Thread(target=connection.drain_events, daemon=True)
        drained.start()
        wait_for(lambda: channel._refused_until > refused, timeout=10, what="a refused fetch")
        assert broker.queued("tools") == [item] and not broker.records()
        server.accept_writes()
        drained.join(REFUSED_RETRY + 5)
        assert not drained.is_alive() and len(got) == 1
        assert got[0].payload == {"call": 3}
        assert list(broker.records()) == [got[0].delivery_tag]
        got[0].ack()
    assert broker.empty("tools")


def test_a_fetch_refused_while_a_script_runs_succeeds_after_it() -> None:
    with redis_server("--busy-reply-threshold", "100") as busy_server:
        busy = Broker(busy_server.client())
        publish(busy_server.url, [("tools", {"call": 4}, {})])
        got: list[Message] = []
        with connect(busy_server.url) as connection, Consumer(
            connection.channel(), [queue("tools")], on_message=got.append,
        ) as consumer:
            looping = threading.Thread(target=_busy_loop, args=(busy_server,), daemon=True)
            looping.start()
            wait_for(lambda: _is_busy(busy_server), timeout=10, what="Redis to be BUSY")
            idle(connection, 1.5)
            assert not got and atomic_channel(consumer)._refused_until > 0
            busy_server.client().script_kill()
            looping.join(10)
            assert len(busy.queued("tools")) == 1 and not busy.records()
            drain_until(connection, lambda: bool(got), timeout=REFUSED_RETRY + 5)
            assert got[0].payload == {"call": 4}
            got[0].ack()
        assert busy.empty("tools")


def _busy_loop(server: RedisServer) -> None:
    with suppress(redis.ResponseError):
        server.client(socket_timeout=60).eval("while true do end", 0)


def _is_busy(server: RedisServer) -> bool:
    try:
        server.client().ping()
    except redis.ResponseError as error:
        return "BUSY" in str(error)
    return False


def test_a_fetch_whose_reply_is_lost_leaves_the_message_for_kombus_restore(
    server: RedisServer, broker: Broker,
) -> None:
    publish(server.url, [("tools", {"call": 5}, {})])
    [item] = broker.queued("tools")
    server.client().script_load(script("fetch").text)  # the first EVALSHA runs it
    with TcpProxy(server.port) as proxy:
        cut = proxy.cut_on(b"EVALSHA", FETCH_SHA.encode(), applied=True, times=1)
        with connect(proxy.url()) as connection, Consumer(
            connection.channel(), [queue("tools")], on_message=lambda message: None,
        ), pytest.raises(redis.ConnectionError):
            drain_until(connection, lambda: False, timeout=10)
    assert cut.hits == 1
    # The script ran: the message is recorded, not queued, and nobody holds it.
    [(tag, record)] = broker.records().items()
    assert record == [json.loads(item), "", "tools"] and not broker.queued("tools")

    def restored() -> bool:
        restore_visible(server.url, visibility_timeout=1)
        return bool(broker.queued("tools"))

    wait_for(restored, timeout=10, what="kombu's restore")
    with connect(server.url) as connection:
        [message] = consume(connection, ["tools"], 1)
    assert message.delivery_tag == tag and message.payload == {"call": 5}
    assert broker.empty("tools")


def test_a_channel_whose_connection_is_lost_with_a_fetch_in_flight_still_closes(
    server: RedisServer,
) -> None:
    """kombu's channel close reads a fetch still in flight first; with the
    server gone that read raises, and kombu's close stopped there: the channel
    stayed open, its clients and waits kept, and the next close (Celery 5.7's
    consumer closes its connection after ``collect()`` cleared the transport's
    ``client``) restored the held messages through a client it could no longer
    build, raising AttributeError, which stopped a worker whose Redis
    restarted under load. The close runs to its end."""
    publish(server.url, [("tools", {"call": n}, {}) for n in range(2)])
    connection = connect(server.url)
    held: list[Message] = []
    consumer = Consumer(connection.default_channel, [queue("tools")], on_message=held.append)
    consumer.consume()
    drain_until(connection, lambda: bool(held), timeout=10)
    channel = atomic_channel(consumer)
    channel._brpop_start()  # the next fetch, sent and not read
    assert channel._in_poll is not None
    server.kill()
    # The held message cannot be restored now (kombu's restore raises the
    # connection error); it stays in unacked for the restore after the
    # visibility timeout, as with kombu's own fetch.
    with suppress(redis.ConnectionError):
        channel.close()
    assert channel.closed and channel._in_poll is None and not channel._waits
    connection.collect(socket_timeout=1)
    connection.close()


# -- 7. no_ack and basic_get -----------------------------------------------------------


def test_a_no_ack_consumer_leaves_nothing_in_unacked(server: RedisServer,
                                                    broker: Broker) -> None:
    publish(server.url, [("tools", n, {}) for n in range(5)])
    with connect(server.url) as connection:
        got = consume(connection, ["tools"], 5, no_ack=True)
        assert [message.payload for message in got] == list(range(5))
        assert broker.empty("tools")


def test_basic_get_records_until_acked_and_no_ack_records_nothing(
    server: RedisServer, broker: Broker,
) -> None:
    publish(server.url, [("tools", n, {"priority": 9 - 3 * n}) for n in range(3)])
    with connect(server.url) as connection:
        held = connection.SimpleQueue(queue("tools"))
        message = held.get(block=False)  # basic_get: the same script, one queue
        assert message.payload == 2  # priority 3: before 6 and 9
        assert broker.records() == {message.delivery_tag: [message._raw, "", "tools"]}
        message.ack()
        assert not broker.records() and not broker.index()
        taken = connection.SimpleQueue(queue("tools"), no_ack=True)
        assert [taken.get(block=False).payload for _ in range(2)] == [1, 0]
        with pytest.raises(taken.Empty):
            taken.get(block=False)
        held.close()
        taken.close()
    assert broker.empty("tools")


# -- 8. expiring queues, queues added while consuming --------------------------------


def test_an_expiring_queue_keeps_its_ttl_when_a_wait_wakes(server: RedisServer,
                                                           broker: Broker) -> None:
    expiring = queue("expiring", expires=60)
    got: list[Message] = []
    with connect(server.url) as connection, Consumer(
        connection.channel(), [expiring], on_message=got.append,
    ) as consumer:
        atomic_channel(consumer).brpop_timeout = 30
        idle(connection)
        waiting = server.client().info("clients")["blocked_clients"]
        assert waiting == 4  # one wait per priority list
        with connect(server.url, atomic=False) as plain:
            Producer(plain.default_channel).publish(
                "ttl", exchange="", routing_key="expiring", declare=[expiring])
        # The wait on the list woke (BLMOVE moved the message onto the list's
        # own end); nothing fetched it yet.
        wait_for(lambda: server.client().info("clients")["blocked_clients"] == waiting - 1,
                 timeout=10, what="the wait to wake")
        assert len(broker.queued("expiring")) == 1
        assert 0 < server.client().pttl("expiring") <= 60_000
        drain_until(connection, lambda: bool(got))
        assert got[0].payload == "ttl"
        got[0].ack()
    assert broker.empty("expiring")


def test_a_queue_added_to_a_running_consumer_is_fetched_at_once(server: RedisServer) -> None:
    got: list[Message] = []
    with connect(server.url) as connection, Consumer(
        connection.channel(), [queue("first")], on_message=got.append,
    ) as consumer:
        atomic_channel(consumer).brpop_timeout = 30  # the waits on "first" sleep on
        idle(connection)
        publish(server.url, [("second", "added", {})])
        consumer.add_queue(queue("second"))
        consumer.consume()
        started = monotonic()
        drain_until(connection, lambda: bool(got), timeout=10)
        assert monotonic() - started < 1.0
        assert got[0].payload == "added"
        got[0].ack()


# -- 9. Sentinel -------------------------------------------------------------------------


def test_the_sentinel_transport_fetches_atomically() -> None:
    with sentinel_set(replicas=0) as group:
        master = Broker(group.master().client())

        def sentinel(atomic: bool) -> Connection:
            transport = SentinelTransport if atomic else kombu_redis.SentinelTransport
            return connect(group.urls, transport=transport, master_name=MASTER)

        with sentinel(atomic=False) as plain:
            Producer(plain.default_channel).publish({"call": 6}, exchange="",
                                                     routing_key="tools")
        [item] = master.queued("tools")
        got: list[Message] = []
        with sentinel(atomic=True) as connection, Consumer(
            connection.channel(), [queue("tools")], on_message=got.append,
        ):
            drain_until(connection, lambda: bool(got))
            assert master.records() == {got[0].delivery_tag: [json.loads(item), "", "tools"]}
            got[0].ack()
            idle(connection)
            with sentinel(atomic=False) as plain:
                Producer(plain.default_channel).publish({"call": 7}, exchange="",
                                                         routing_key="tools")
            drain_until(connection, lambda: len(got) == 2, timeout=5)
            got[1].ack()
        assert [message.payload for message in got] == [{"call": 6}, {"call": 7}]
        assert master.empty("tools")


