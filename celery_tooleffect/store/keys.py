"""Redis key names, all under one prefix.

The atomic unit is a run: its journal entries and its audit events share the
hash tag ``{run_id}`` so that the transition scripts work on Redis Cluster.
Dead-letter keys share the tag ``{dlq:<queue>}`` on a single Redis; on a
Redis Cluster (``Keys(prefix, dead_letters_in_one_slot=True)``) every
dead-letter key, the indexes across queues included, shares the one tag
``{dlq}``, so that the dead-letter scripts, which keep a letter and all its
index entries together, touch one slot. Only dead-lettering, replaying,
purging and listing touch that slot: no tool call does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


def hash_tag(value: str) -> str:
    """``value`` made safe to sit between the braces of a hash tag."""
    return value.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _facet(value: str) -> str:
    """``value`` made safe to be one ``:``-separated part of a key name."""
    return hash_tag(value).replace(":", "%3A")


def unescape_hash_tag(value: str) -> str:
    """The inverse of :func:`hash_tag`."""
    return value.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


#: The streams of the global copy on a Redis Cluster store: 16 slots spread
#: over the nodes, where one stream would put every call's copy on one node.
GLOBAL_STREAM_SHARDS = 16


@dataclass(frozen=True)
class Keys:
    """Key names under ``prefix``."""

    prefix: str = "tooleffect:"
    #: The dead letters are kept on a Redis Cluster: every dead-letter key is
    #: named ``<prefix>{dlq}:...``, in one slot (see the module's docstring).
    dead_letters_in_one_slot: bool = False
    #: How many streams the global copy is spread over: 1 on a single Redis,
    #: :data:`GLOBAL_STREAM_SHARDS` on a Redis Cluster (:func:`store_keys`).
    global_stream_shards: int = 1

    def _dlq(self, name: str, queue: str | None = None) -> str:
        """A dead-letter key: ``name`` of ``queue`` (a per-queue key) or of all queues."""
        if self.dead_letters_in_one_slot:
            if queue is None:
                return f"{self.prefix}{{dlq}}:{name}"
            return f"{self.prefix}{{dlq}}:queue:{_facet(queue)}:{name}"
        if queue is None:
            return f"{self.prefix}dlq:{name}"
        return f"{self.prefix}{{dlq:{hash_tag(queue)}}}:{name}"

    def run(self, run_id: str) -> str:
        # Redis ignores an empty tag ("{}") and hashes the whole key, which
        # would scatter an empty run id's keys over slots; a lone "%" is what
        # no escaped id can be.
        return f"{self.prefix}{{{hash_tag(run_id) or '%'}}}"

    def journal(self, run_id: str, task_id: str) -> str:
        """The journal entry (a hash) of one task of a run."""
        return f"{self.run(run_id)}:journal:{task_id}"

    def run_events(self, run_id: str) -> str:
        """The audit events of one run: a list, its header first
        (:mod:`celery_tooleffect.store.chain`)."""
        return f"{self.run(run_id)}:events"

    @property
    def global_events(self) -> str:
        """The stream all events are copied to, best effort, for tailing (on a
        single Redis; on a cluster, :attr:`global_streams`)."""
        return f"{self.prefix}events"

    @property
    def global_streams(self) -> list[str]:
        """Every stream of the global copy: :attr:`global_events` alone, or on a
        Redis Cluster :data:`GLOBAL_STREAM_SHARDS` streams ``<prefix>events:{<n>}``,
        each in a slot of its own, so that no slot takes every call's copy."""
        if self.global_stream_shards == 1:
            return [self.global_events]
        return [f"{self.prefix}events:{{{n}}}" for n in range(self.global_stream_shards)]

    def global_stream(self, run_id: str) -> str:
        """The global stream a run's events are copied to (one per run, so a run's
        copies keep their order)."""
        if self.global_stream_shards == 1:
            return self.global_events
        shard = zlib.crc32(run_id.encode("utf-8", "surrogatepass")) % self.global_stream_shards
        return f"{self.prefix}events:{{{shard}}}"

    def writer(self, process: str) -> str:
        """The count of intents one worker process had acknowledged, as the
        store last kept it (:mod:`celery_tooleffect.store.rollback`)."""
        return f"{self.prefix}store:writer:{process}"

    @property
    def rollback(self) -> str:
        """The hash that says when a rollback of the store was last detected."""
        return f"{self.prefix}store:rollback"

    def dead_letters(self, queue: str) -> str:
        """The hash of dead-letter envelopes of ``queue``, by task id."""
        return self._dlq("envelopes", queue)

    def dead_letter_index(self, queue: str) -> str:
        """The sorted set of a queue's dead letters by the time they were stored."""
        return self._dlq("index", queue)

    @property
    def dead_letter_queues(self) -> str:
        """The set of queues that have (or had) dead letters."""
        return self._dlq("queues")

    @property
    def dead_letter_locations(self) -> str:
        """Task id to queue, so that a dead letter is found by task id alone."""
        return self._dlq("where")

    # -- dead-letter indexes (paging and counts without scans) ---------------

    @property
    def dead_letter_all(self) -> str:
        """The sorted set of every queue's dead letters by the time they were stored."""
        return self._dlq("index")

    def dead_letter_facet(self, facet: str, value: str) -> str:
        """The sorted set, by time, of the dead letters whose ``facet`` is ``value``.

        ``facet`` is ``reason``, ``failure_class`` or ``effect``.
        """
        return self._dlq(f"by:{facet}:{hash_tag(value)}")

    @property
    def dead_letter_facets(self) -> str:
        """The set of ``facet:value`` pairs that have (or had) dead letters."""
        return self._dlq("facets")

    @property
    def dead_letter_counts(self) -> str:
        """The number of dead letters of each queue, reason, failure class and effect
        together (a hash; field: the four values as a JSON array)."""
        return self._dlq("counts")

    @property
    def dead_letter_replaying(self) -> str:
        """Dead letters taken out of the store by a replay that has not finished yet."""
        return self._dlq("replaying")

    def call_claim(self, task_id: str) -> str:
        """The publish-time claim of a task id (a hash: its tool and argument
        digest), in a slot of its own: a task id names one call across runs,
        as it names one Celery result."""
        return f"{self.prefix}call:{{{hash_tag(task_id) or '%'}}}"

    @property
    def declared_effects(self) -> str:
        """The effects the live workers declare (a hash; field: a worker's node
        name, value: its release and its tools' effects, as JSON, with when the
        entry lapses). See :mod:`celery_tooleffect.store.declarations`."""
        return f"{self.prefix}workers:effects"

    # -- approvals -------------------------------------------------------------

    def approval(self, run_id: str, task_id: str) -> str:
        """The approval record (a hash) of one call: in its run's slot, so that a
        decision and its audit event are written by one script."""
        return f"{self.run(run_id)}:approval:{task_id}"

    @property
    def approvals_pending(self) -> str:
        """The sorted set of calls awaiting a decision (or the publication of
        one), by the time they were parked."""
        return f"{self.prefix}approvals:pending"

    @property
    def approvals_where(self) -> str:
        """Task id to run id, so that an approval is found by task id alone."""
        return f"{self.prefix}approvals:where"

    def approvals_decided(self, state: str, *, queue: str | None = None,
                          tool: str | None = None) -> str:
        """The sorted set of the calls decided ``state`` (``approved``,
        ``rejected``, ``expired``), by the time of the decision: all of them, or
        those of one queue, of one tool, or of both."""
        key = f"{self.prefix}approvals:decided:{state}"
        if queue is not None:
            key += f":queue:{_facet(queue)}"
        if tool is not None:
            key += f":tool:{_facet(tool)}"
        return key


def store_keys(prefix: str, *, cluster: bool) -> Keys:
    """The key names of a store under ``prefix``; ``cluster``: the store is a
    Redis Cluster, whose global copy is spread over :data:`GLOBAL_STREAM_SHARDS`
    streams."""
    return Keys(prefix, global_stream_shards=GLOBAL_STREAM_SHARDS if cluster else 1)
