# mypy: disallow-untyped-decorators=False
# (Celery ships no type hints: @app.task is untyped, as it is in any user code.)
"""The Celery app the benchmark's ``celery worker`` processes run.

One body, six ways to run it: a plain Celery task with ``acks_late=True``
fetched by kombu's own ``BRPOP`` (the baseline: what users run today), the
same task fetched by the package's atomic fetch, and the four ``ToolTask``
variants the benchmark compares with them (atomic fetch). By default the body
does nothing, so that what is measured is the price the package adds to every
call; ``BENCH_BODY_SECONDS`` makes it wait, as a tool waiting on a provider does.

Which fetch a worker uses is ``BENCH_FETCH``: ``atomic`` (the default: the
package's fetch, on because this app binds ``ToolTask``s) or ``kombu``
(``tooleffect_atomic_fetch = False``: kombu's ``BRPOP`` and ``QoS.append``).
Both kinds of worker run this same module, so the two plain rows differ in the
fetch alone; a variant is run by a worker of its fetch (:data:`FETCH`).

Configured from the environment by ``bench.servers``: ``BENCH_PREFIX`` (every key
of the run), ``BENCH_BROKER``, ``BENCH_BACKEND`` and ``BENCH_STORE`` (the
Redis URLs of the broker, the result backend and the package's store: the
round-trip phase points each at its own counting proxy), and
``BENCH_PREFETCH`` (Celery's ``worker_prefetch_multiplier``), and
``BENCH_GLOBAL_MAXLEN`` (the audit phase fills the global stream past the
default cap of 100,000), ``BENCH_STORE_REPLICAS``
(``tooleffect_store_replicas``: each journal write waits for that many
replicas, ``--store-replicas``), ``BENCH_FETCH`` (see above),
``BENCH_STORE_CLUSTER`` (``1``: the store is a Redis Cluster),
``BENCH_QUORUM_QUEUE`` (a RabbitMQ quorum queue to declare: ``bench.cluster``)
and ``BENCH_POOL_LIMIT`` (``broker_pool_limit`` and the Redis transport's
``max_connections``: the pools matrix raises them for gevent).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask

#: The queue every worker listens to when it is not measuring anything.
IDLE_QUEUE = "bench-idle"
#: The queue of the latency rounds (one call at a time) of the atomic fetch's workers.
LATENCY_QUEUE = "bench-latency"

#: The two fetches (``BENCH_FETCH``): the package's atomic fetch, kombu's own.
ATOMIC = "atomic"
KOMBU = "kombu"


def latency_queue(fetch: str) -> str:
    """The latency rounds' queue of the workers with ``fetch`` (each kind its own,
    so that a call is run by a worker of its variant's fetch)."""
    return LATENCY_QUEUE if fetch == ATOMIC else f"{LATENCY_QUEUE}-{fetch}"


def config(
    prefix: str,
    broker: str,
    *,
    backend: str | None = None,
    store: str | None = None,
    prefetch: int = 4,
    global_maxlen: int = 100_000,
    store_replicas: int = 0,
    fetch: str = ATOMIC,
    volatile: bool = False,
    store_cluster: bool = False,
    quorum_queue: str = "",
    pool_limit: int | None = None,
) -> dict[str, Any]:
    """The settings of every app of one benchmark run (workers, producers, CLI).

    Every key lives under ``prefix``; the visibility timeout is kombu's default.
    ``fetch`` is the worker's fetch from the broker (:data:`ATOMIC` or :data:`KOMBU`);
    ``volatile``: the run's Redis keeps nothing on disk (``--no-appendonly``),
    which the workers accept (``tooleffect_allow_volatile_store``);
    ``store_cluster``: ``store`` is a node of a Redis Cluster
    (``tooleffect_redis_cluster``); ``quorum_queue``: a queue declared as a
    RabbitMQ quorum queue (``x-queue-type: quorum``), by workers and producers alike;
    ``pool_limit``: Celery's ``broker_pool_limit`` and kombu's Redis
    ``max_connections`` (None: 10 each; plain Celery on a gevent pool of 50
    fails its acknowledgements with ``MaxConnectionsError`` below its
    concurrency).
    """
    if fetch not in (ATOMIC, KOMBU):
        raise ValueError(f"unknown fetch {fetch!r} (BENCH_FETCH): {ATOMIC} or {KOMBU}")
    queues: dict[str, Any] = {}
    if quorum_queue:
        from kombu.entity import Exchange, Queue

        queues["task_queues"] = [
            Queue(IDLE_QUEUE),  # type: ignore[no-untyped-call]
            Queue(quorum_queue, Exchange(quorum_queue, type="direct"),  # type: ignore[no-untyped-call]
                  routing_key=quorum_queue, queue_arguments={"x-queue-type": "quorum"}),
        ]
    return {
        **queues,
        "broker_url": broker,
        "result_backend": backend or broker,
        "broker_transport_options": {"global_keyprefix": prefix, "visibility_timeout": 3600,
                                     **({"max_connections": pool_limit} if pool_limit else {})},
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "broker_connection_retry_on_startup": True,
        "task_default_queue": IDLE_QUEUE,
        "worker_prefetch_multiplier": prefetch,
        "worker_hijack_root_logger": True,
        "tooleffect_key_prefix": f"{prefix}te:",
        "tooleffect_redis_url": store,
        "tooleffect_global_stream_maxlen": global_maxlen,
        "tooleffect_store_replicas": store_replicas,
        "tooleffect_atomic_fetch": fetch == ATOMIC,
        "tooleffect_allow_volatile_store": volatile,
        "tooleffect_redis_cluster": store_cluster,
        **({"broker_pool_limit": pool_limit} if pool_limit else {}),
    }


app = Celery("bench")
app.conf.update(
    config(
        os.environ.get("BENCH_PREFIX", "bench:"),
        os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"),
        backend=os.environ.get("BENCH_BACKEND") or None,
        store=os.environ.get("BENCH_STORE") or None,
        prefetch=int(os.environ.get("BENCH_PREFETCH", "4")),
        global_maxlen=int(os.environ.get("BENCH_GLOBAL_MAXLEN", "100000")),
        store_replicas=int(os.environ.get("BENCH_STORE_REPLICAS", "0")),
        fetch=os.environ.get("BENCH_FETCH", ATOMIC),
        volatile=os.environ.get("BENCH_VOLATILE") == "1",
        store_cluster=os.environ.get("BENCH_STORE_CLUSTER") == "1",
        quorum_queue=os.environ.get("BENCH_QUORUM_QUEUE", ""),
        pool_limit=int(os.environ.get("BENCH_POOL_LIMIT") or 0) or None,
    )
)


#: Seconds each body waits, as a tool waiting on its provider would
#: (``--body-ms``); 0 by default, so that the tables show the whole price.
BODY_SECONDS = float(os.environ.get("BENCH_BODY_SECONDS", "0"))


def work(n: int) -> int:
    """The body every variant shares."""
    if BODY_SECONDS:
        time.sleep(BODY_SECONDS)
    return n


@app.task(name="bench.plain", acks_late=True)
def plain(n: int) -> int:
    return work(n)


@app.task(base=ToolTask, name="bench.read_only")
def read_only(n: int) -> int:
    return work(n)


@app.task(base=ToolTask, name="bench.idempotent_write", effect=ToolEffect.IDEMPOTENT_WRITE)
def idempotent_write(n: int) -> int:
    return work(n)


@app.task(base=ToolTask, name="bench.non_idempotent_write",
          effect=ToolEffect.NON_IDEMPOTENT_WRITE)
def non_idempotent_write(n: int) -> int:
    return work(n)


@app.task(base=ToolTask, name="bench.non_idempotent_deadline",
          effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=60)
def non_idempotent_deadline(n: int) -> int:
    return work(n)


#: The baseline: plain Celery as users run it today, fetched by kombu's BRPOP.
BASELINE = "plain celery, kombu's fetch"
#: Plain Celery fetched by the package's atomic fetch.
PLAIN_ATOMIC = "plain celery, atomic fetch"

#: The variants (their task), baseline first, in the order the rounds interleave them.
VARIANTS = {
    BASELINE: "bench.plain",
    PLAIN_ATOMIC: "bench.plain",
    "READ_ONLY": "bench.read_only",
    "IDEMPOTENT_WRITE": "bench.idempotent_write",
    "NON_IDEMPOTENT_WRITE": "bench.non_idempotent_write",
    "NON_IDEMPOTENT_WRITE + deadline": "bench.non_idempotent_deadline",
}

#: The fetch of the workers that run each variant: the baseline kombu's, every
#: other one the package's atomic fetch.
FETCH = {variant: KOMBU if variant == BASELINE else ATOMIC for variant in VARIANTS}


# -- cProfile of the worker's processes (``python -m bench.profile --cprofile``) --

if os.environ.get("BENCH_CPROFILE"):
    import cProfile

    from celery import signals

    _profiles: dict[str, cProfile.Profile] = {}

    def _start(kind: str) -> None:
        profile = cProfile.Profile()
        _profiles[kind] = profile
        profile.enable()

    def _dump(kind: str) -> None:
        profile = _profiles.pop(kind, None)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(os.environ["BENCH_CPROFILE"],
                                            f"{kind}-{os.getpid()}.prof"))

    signals.worker_init.connect(lambda **_: _start("main"), weak=False)
    signals.worker_shutdown.connect(lambda **_: _dump("main"), weak=False)
    signals.worker_process_init.connect(lambda **_: _start("pool"), weak=False)
    signals.worker_process_shutdown.connect(lambda **_: _dump("pool"), weak=False)
