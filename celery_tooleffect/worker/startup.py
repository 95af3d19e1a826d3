"""Checks a worker runs once at start, before it consumes anything.

A configuration that would break a guarantee stops the worker with a clear
error; one that only weakens it is warned about loudly:

- on Redis, ``tooleffect_backoff_cap`` must be below the visibility timeout: a
  retry waiting for its countdown sits unacknowledged in a worker's memory, and
  kombu would restore it (so it runs twice) once the visibility timeout lapses.
  The same holds for a tool's ``autoretry_for`` countdown (``retry_kwargs``
  countdown, or ``retry_backoff_max`` with ``retry_backoff``);
  An ``operation_deadline`` may exceed the visibility timeout (that is what it
  is for): its lease is extended, and a delivery deferred to a live owner's
  lease end waits at most 80 % of the visibility timeout before it looks again
  (see ``worker.endings.defer_to_owner``). Refusing it too was considered; the
  documentation's Decisions page says why it was not kept;
- on RabbitMQ, a deadline longer than the broker's ``consumer_timeout``
  (``tooleffect_rabbitmq_consumer_timeout``) would have the channel closed
  under a running write;
- on a broker without a visibility timeout (RabbitMQ) there is no broker
  lease to extend; every write heartbeats its journal lease instead (said once);
- a tool's ``default_retry_delay`` (the wait of a ``self.retry()`` without a
  countdown: the tool's own choice) not below the visibility timeout is
  warned about;
- the prefetch multiplier is checked per pool (:func:`prefetch_advice`): 1 on
  prefork, threads and solo, whose event loop fetches the moment a call ends
  (prefetched messages would only wait with their visibility timeout
  running); more than 1 on gevent and eventlet, whose consumer fetches only
  when its poll wakes, so that 1 caps them near their concurrency in calls a
  second;
- a store (or a broker holding dead letters) that can lose acknowledged writes
  when its process restarts (no AOF) is refused unless replicas are waited
  for (``tooleffect_allow_volatile_store`` makes it a warning), and AOF that a
  machine crash can cut short is warned about
  (:func:`~celery_tooleffect.worker.replication.persistence_check`);
- a store (or dead-letter store) whose ``maxmemory-policy`` can evict the
  package's keys while ``maxmemory`` is set is refused
  (``tooleffect_allow_eviction`` makes it a warning); see
  :mod:`celery_tooleffect.worker.eviction`, which also watches evictions while
  the worker runs;
- behind Sentinel, a master name the Sentinels do not know, and replicas or
  fsync asked for (``tooleffect_store_replicas``, ``tooleffect_store_fsync``)
  that the store cannot give, are refused; a store with replicas and no
  ``WAIT`` is warned about (:mod:`celery_tooleffect.worker.replication`);
- a queue holding more unresolved dead letters than
  ``tooleffect_dead_letter_warn_count``, or one older than
  ``tooleffect_dead_letter_warn_age``, is warned about (an unreachable
  dead-letter store is not: the checks above speak for it).

Every warning it logs names its section of ``docs/operations.md`` ("Start-up
warnings": what it means and what to do), e.g. ``see
docs/operations.md#prefetch``.

And one thing it keeps doing while it runs (:class:`DeclaredEffects`): it
publishes the effect each of its tools declares, with its release
(``tooleffect_release``), in the store
(:mod:`celery_tooleffect.store.declarations`), and warns when another live
worker declares one of its tools with another effect (a rolling upgrade that
changes an effect: the journal then handles each call under the strictest
effect it recorded).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import bootsteps

from ..effect import ToolEffect
from ..errors import ConfigurationError, StoreUnavailable
from ..settings import Settings, settings_for
from ..store.dead_letter_queries import backlog_warnings
from ..store.declarations import EffectDeclarations, WorkerDeclaration, disagreements
from ..store.runtime import runtime_for
from .eviction import EvictionWatch, eviction_check
from .heartbeat import heartbeat_interval
from .replication import ReplicaWatch, durability_check, persistence_check
from .retries import RetryPolicy

logger = logging.getLogger(__name__)


def largest_deadline(app: Any) -> tuple[float, str]:
    """The largest ``operation_deadline`` of the app's tools, and whose it is."""
    largest, owner = 0.0, ""
    for name, task in app.tasks.items():
        deadline = getattr(task, "operation_deadline", None)
        if deadline and float(deadline) > largest:
            largest, owner = float(deadline), name
    return largest, owner


#: The multiplier recommended for gevent and eventlet (Celery's default): a
#: prefetched message waits about (multiplier - 1) calls' time there.
GREEN_PREFETCH = 4


def prefetch_advice(multiplier: int, pool: Any) -> str | None:
    """What to say of ``worker_prefetch_multiplier`` on ``pool`` (a Celery pool
    class; None: prefork), or None when it is the one recommended.

    A prefetched message is delivered and unacknowledged while it waits in the
    worker, its visibility timeout running (past it kombu gives it to another
    worker, whose copy the journal defers or refuses); the atomic fetch and the
    leases protect a call once it runs, not while it waits. On prefork,
    threads and solo the event loop fetches as soon as a call ends (it is woken
    when a pool thread acknowledges), so 1 costs nothing and nothing waits. On
    gevent and eventlet (``is_green``) the consumer fetches only when its poll
    wakes, about once a second after every greenlet is busy: 1 caps the pool
    near its concurrency in calls a second. There a message waits about
    (multiplier - 1) calls' time, whatever the concurrency, so
    :data:`GREEN_PREFETCH` is recommended while the longest call times 3 stays
    well under the visibility timeout.
    """
    if getattr(pool, "is_green", False):
        if multiplier > 1:
            return None
        return (f"{multiplier} on a green pool ({_pool_name(pool)}); {GREEN_PREFETCH} is "
                f"recommended there: its consumer fetches only when its poll wakes, so "
                f"{multiplier} caps it near its concurrency in calls a second")
    if multiplier == 1:
        return None
    return (f"{multiplier} on the {_pool_name(pool)} pool; 1 is recommended there (prefetched "
            "messages wait with their visibility timeout running, and the worker fetches "
            "as soon as a call ends)")


def _pool_name(pool: Any) -> str:
    if pool is None:
        return "prefork"
    module = str(getattr(pool, "__module__", "") or "").rsplit(".", 1)[-1]
    # Celery's module of the threads pool is celery.concurrency.thread.
    return {"thread": "threads"}.get(module, module) or str(pool)


def configuration_errors(app: Any, settings: Settings) -> list[str]:
    """What in the configuration would break a guarantee (empty when nothing)."""
    errors: list[str] = []
    deadline, owner = largest_deadline(app)
    if settings.broker_is_redis and settings.backoff_cap >= settings.visibility_timeout:
        errors.append(
            f"tooleffect_backoff_cap ({settings.backoff_cap:g}s) is not below the broker's "
            f"visibility_timeout ({settings.visibility_timeout:g}s): a retry waiting for its "
            "countdown would be restored and run twice"
        )
    if settings.broker_is_redis:
        errors.extend(autoretry_errors(app, settings))
    amqp = str(settings.broker_url).startswith(("amqp", "pyamqp", "amqps"))
    if amqp and deadline > settings.rabbitmq_consumer_timeout:
        errors.append(
            f"operation_deadline of {owner} ({deadline:g}s) is longer than RabbitMQ's "
            f"consumer_timeout ({settings.rabbitmq_consumer_timeout:g}s, "
            "tooleffect_rabbitmq_consumer_timeout)"
        )
    return errors


def autoretry_errors(app: Any, settings: Settings) -> list[str]:
    """Tools whose ``autoretry_for`` countdown could outlast the visibility timeout."""
    errors = []
    for name, task in sorted(app.tasks.items()):
        if not getattr(task, "autoretry_for", None) or not hasattr(task, "retry_policy"):
            continue
        longest = RetryPolicy.of(task, settings, task.tool_effect).longest_countdown()
        if longest >= settings.visibility_timeout:
            errors.append(
                f"{name}: its autoretry_for countdown can reach {longest:g}s "
                "(retry_kwargs countdown, or retry_backoff_max with retry_backoff), not below "
                f"the broker's visibility_timeout ({settings.visibility_timeout:g}s): a retry "
                "waiting for its countdown would be restored and run twice"
            )
    return errors


def run_checks(app: Any, pool: Any = None) -> None:
    """Raise ConfigurationError, or log warnings, for this app's configuration
    on a worker of ``pool`` (its pool class; None: prefork)."""
    settings = settings_for(app)
    errors = configuration_errors(app, settings)
    if errors:
        raise ConfigurationError("celery-tooleffect: " + "; ".join(errors))
    runtime = runtime_for(app)
    refusals, store_warnings = durability_check(runtime)
    evictions, eviction_warnings = eviction_check(runtime)
    volatile, persistence_warnings = persistence_check(runtime)
    refusals += evictions + volatile
    if refusals:
        raise ConfigurationError("celery-tooleffect: " + "; ".join(refusals))
    for warning in persistence_warnings:
        logger.warning("celery-tooleffect: %s; see docs/operations.md#persistence", warning)
    for warning in store_warnings:
        logger.warning("celery-tooleffect: %s; see docs/operations.md#replicas", warning)
    for warning in eviction_warnings:
        logger.warning("celery-tooleffect: %s; see docs/operations.md#eviction", warning)
    try:
        waiting = backlog_warnings(runtime.dead_letters.backlog(), settings, time.time())
    except StoreUnavailable:
        waiting = []  # a worker starts without its dead letters; they are not lost
    for warning in waiting:
        logger.warning("celery-tooleffect: %s; see docs/operations.md#dead-letters-waiting",
                       warning)
    if not settings.broker_is_redis:
        interval = heartbeat_interval(settings, None)
        logger.warning(
            "celery-tooleffect: the broker has no visibility timeout (RabbitMQ gives a "
            "message back when its channel closes): every write heartbeats a journal lease "
            "of %gs (3 x tooleffect_heartbeat_interval); there is no broker lease to extend; "
            "see docs/operations.md#heartbeats-on-rabbitmq",
            3 * interval,
        )
    advice = prefetch_advice(int(app.conf.worker_prefetch_multiplier), pool)
    if advice:
        logger.warning("celery-tooleffect: worker_prefetch_multiplier is %s; see "
                       "docs/operations.md#prefetch", advice)
    if settings.broker_is_redis:
        for name, task in sorted(app.tasks.items()):
            delay = getattr(task, "default_retry_delay", None)
            if hasattr(task, "retry_policy") and delay and delay >= settings.visibility_timeout:
                logger.warning(
                    "celery-tooleffect: %s: a self.retry() without a countdown waits its "
                    "default_retry_delay (%ss), not below the visibility_timeout (%ss): the "
                    "waiting retry would be restored and delivered twice (a write is then "
                    "deferred, a read runs twice); see docs/operations.md#retry-delay",
                    name, delay, settings.visibility_timeout,
                )


class StartupChecks(bootsteps.Step):  # type: ignore[misc]
    """Worker step that runs :func:`run_checks` when the worker is built."""

    name = "celery_tooleffect.startup_checks"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        run_checks(worker.app, getattr(worker, "pool_cls", None))


def declared_effects(app: Any) -> dict[str, str]:
    """Each tool of ``app``'s registry, by name, with the effect its code declares."""
    tools = {}
    for name, task in app.tasks.items():
        try:
            effect = getattr(task, "tool_effect", None)
        except Exception:  # a tool that cannot say: the worker refuses it elsewhere
            continue
        if isinstance(effect, ToolEffect):
            tools[str(name)] = effect.value
    return dict(sorted(tools.items()))


class EffectDeclarer:
    """Publishes what one worker declares and warns about live workers that
    declare otherwise: each disagreement (tool, other worker, both effects)
    once per worker process. :meth:`refresh` never raises."""

    def __init__(self, store: EffectDeclarations, worker: str, *, release: str,
                 tools: dict[str, str], ttl: float) -> None:
        self.store = store
        self.worker = worker
        self.release = release
        self.tools = tools
        self.ttl = ttl
        self.warned: set[tuple[str, str, str, str]] = set()
        self._store_down = False

    def refresh(self) -> None:
        """Write this worker's entry again (pushing its lapse out) and warn
        about new disagreements with the live entries read with it."""
        try:
            live = self.store.publish(self.worker, release=self.release, tools=self.tools,
                                      ttl=self.ttl, pid=os.getpid())
        except StoreUnavailable as exc:
            if not self._store_down:  # once per outage, not once per tick
                logger.warning("celery-tooleffect: the effects of %s's tools are not "
                               "published: %s; see docs/operations.md#declared-effects",
                               self.worker, exc)
            self._store_down = True
            return
        self._store_down = False
        own = WorkerDeclaration(self.worker, self.release, self.tools)
        for found in disagreements(own, live):
            seen = (found.tool, found.other.worker, found.effect, found.other_effect)
            if seen in self.warned:
                continue
            self.warned.add(seen)
            strictest = ToolEffect.strictest(found.effect, found.other_effect).value
            logger.warning(
                "celery-tooleffect: tool %s is declared %s by this worker %s and %s by the "
                "live worker %s. Releases disagree about its effect (a rolling upgrade?): "
                "each call is handled under the strictest effect its journal recorded, so a "
                "call recorded %s stays %s on every worker; finish the upgrade or roll it "
                "back (celery -A app tooleffect tools lists the workers); see "
                "docs/operations.md#declared-effects",
                found.tool, found.effect, own.label(), found.other_effect,
                found.other.label(), strictest, strictest,
            )

    def withdraw(self) -> None:
        """Delete this worker's entry (best effort: else it lapses)."""
        try:
            self.store.withdraw(self.worker)
        except StoreUnavailable as exc:
            logger.info("celery-tooleffect: the entry of %s in the declared effects is "
                        "left to lapse: %s", self.worker, exc)


class DeclaredEffects(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker step: an :class:`EffectDeclarer` on the worker's timer, in the
    worker's main process. It publishes at start (before anything is
    consumed), again every :attr:`interval` seconds, and deletes the entry
    when the worker stops; the entry of a worker that died lapses
    :attr:`lives` intervals after its last refresh."""

    name = "celery_tooleffect.declared_effects"
    requires = ("celery.worker.components:Timer",)

    #: Seconds between two refreshes of a worker's entry (tests lower it).
    interval = 30.0
    #: Refreshes an entry outlives: a worker is presumed dead after this many
    #: intervals without one.
    lives = 3

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None
        self.declarer: EffectDeclarer | None = None

    def start(self, worker: Any) -> None:
        app = worker.app
        tools = declared_effects(app)
        if not tools:
            return
        try:
            settings = settings_for(app)
            self.declarer = EffectDeclarer(
                EffectDeclarations(settings), str(worker.hostname), release=settings.release,
                tools=tools, ttl=self.interval * self.lives,
            )
        except Exception as exc:  # never stops the worker
            logger.warning("celery-tooleffect: declared effects are not published: %r; see "
                           "docs/operations.md#declared-effects", exc)
            return
        self.declarer.refresh()
        self.tref = worker.timer.call_repeatedly(self.interval, self.declarer.refresh)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        if self.declarer is not None:
            self.declarer.withdraw()
            self.declarer = None

    def terminate(self, worker: Any) -> None:
        # A cold shutdown calls this instead of stop (an embedded worker's
        # too): the worker goes all the same, and so does its entry.
        self.stop(worker)


def install_startup_checks(app: Any) -> None:
    """Add :class:`StartupChecks`, the eviction watch
    (:class:`~celery_tooleffect.worker.eviction.EvictionWatch`), the replica
    watch (:class:`~celery_tooleffect.worker.replication.ReplicaWatch`) and
    :class:`DeclaredEffects` to the app's worker steps (idempotent)."""
    app.steps["worker"].add(StartupChecks)
    app.steps["worker"].add(EvictionWatch)
    app.steps["worker"].add(ReplicaWatch)
    app.steps["worker"].add(DeclaredEffects)
