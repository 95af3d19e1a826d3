"""Redis key names, all under one prefix.

The atomic unit is a run: its journal entries, its audit stream and its event
counter share the hash tag ``{run_id}`` so that the transition scripts work on
Redis Cluster. Dead-letter keys share the tag ``{dlq:<queue>}``.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Keys:
    """Key names under ``prefix``."""

    prefix: str = "tooleffect:"

    def run(self, run_id: str) -> str:
        # Redis ignores an empty tag ("{}") and hashes the whole key, which
        # would scatter an empty run id's keys over slots; a lone "%" is what
        # no escaped id can be.
        return f"{self.prefix}{{{hash_tag(run_id) or '%'}}}"

    def journal(self, run_id: str, task_id: str) -> str:
        """The journal entry (a hash) of one task of a run."""
        return f"{self.run(run_id)}:journal:{task_id}"

    def run_events(self, run_id: str) -> str:
        """The audit stream of one run."""
        return f"{self.run(run_id)}:events"

    def run_seq(self, run_id: str) -> str:
        """The chain of a run's audit events: their counter and the newest hash."""
        return f"{self.run(run_id)}:seq"

    @property
    def global_events(self) -> str:
        """The stream all events are copied to, best effort, for tailing."""
        return f"{self.prefix}events"

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
        return f"{self.prefix}{{dlq:{hash_tag(queue)}}}:envelopes"

    def dead_letter_index(self, queue: str) -> str:
        """The sorted set of a queue's dead letters by the time they were stored."""
        return f"{self.prefix}{{dlq:{hash_tag(queue)}}}:index"

    @property
    def dead_letter_queues(self) -> str:
        """The set of queues that have (or had) dead letters."""
        return f"{self.prefix}dlq:queues"

    @property
    def dead_letter_locations(self) -> str:
        """Task id to queue, so that a dead letter is found by task id alone."""
        return f"{self.prefix}dlq:where"

    # -- dead-letter indexes (paging and counts without scans) ---------------

    @property
    def dead_letter_all(self) -> str:
        """The sorted set of every queue's dead letters by the time they were stored."""
        return f"{self.prefix}dlq:index"

    def dead_letter_facet(self, facet: str, value: str) -> str:
        """The sorted set, by time, of the dead letters whose ``facet`` is ``value``.

        ``facet`` is ``reason``, ``failure_class`` or ``effect``.
        """
        return f"{self.prefix}dlq:by:{facet}:{hash_tag(value)}"

    @property
    def dead_letter_facets(self) -> str:
        """The set of ``facet:value`` pairs that have (or had) dead letters."""
        return f"{self.prefix}dlq:facets"

    @property
    def dead_letter_counts(self) -> str:
        """The number of dead letters of each queue, reason, failure class and effect
        together (a hash; field: the four values as a JSON array)."""
        return f"{self.prefix}dlq:counts"

    @property
    def dead_letter_replaying(self) -> str:
        """Dead letters taken out of the store by a replay that has not finished yet."""
        return f"{self.prefix}dlq:replaying"

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
