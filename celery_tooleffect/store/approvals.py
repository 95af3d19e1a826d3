"""Calls that wait for a person's approval, kept in the store's Redis.

A parked call's record is a hash in its run's hash slot
(:meth:`Keys.approval`), so that parking it and each decision are one script
with their audit event (``approval_request.lua``, ``approval_transition.lua``).
The record holds the message exactly as the broker delivered it (a
:class:`~celery_tooleffect.store.envelope.MessageEnvelope`, as a dead letter
does), what the call is (tool, queue, run, its arguments described at
``tooleffect_privacy``), when it was parked, and, once decided, who decided,
when and why. Its states are :class:`~celery_tooleffect.store.states.ApprovalState`.

Two indexes live outside the run's slot and are written in the same round
trip, best effort: ``approvals:pending`` (task ids by the time they were
parked: calls awaiting a decision, or the publication of one) and
``approvals:where`` (task id to run id). A redelivery of a parked call and
every decision repair them, and a listing skips entries whose record is gone.
The number of pending calls is human-sized (each waits for a person), so
listing and counting read the pending index whole (three round trips).

A decided call leaves the pending index once its message is published again,
but stays listed by its decision for ``tooleffect_approval_retention``
(:meth:`ApprovalStore.decided`): each decision (approved, rejected, expired)
adds it, scored by the time of the decision, to ``approvals:decided:<state>``
and to that index per queue, per tool and per queue and tool (so a filtered
page reads only what it shows), written right after the decision's script,
best effort, and trimmed of what is past the retention as it is written. A
page of decided calls costs three round trips and ``O(log n + limit)``,
whatever the number of decisions kept. The record of a decided call lives at
least as long (:attr:`Settings.approval_ttl`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from ..errors import StoreUnavailable
from ..events import AuditEvent
from ..settings import Settings
from ..states import ApprovalState
from .audit import AuditLog, flatten, text
from .connections import client_for
from .envelope import MessageEnvelope
from .keys import Keys
from .lua import script
from .states import END_REFUSED_FROM, approval_argument

logger = logging.getLogger(__name__)

#: The decisions a call stays listed by (``approvals list --state``) for
#: ``tooleffect_approval_retention``.
DECISIONS = frozenset({ApprovalState.APPROVED, ApprovalState.REJECTED, ApprovalState.EXPIRED})


@dataclass(frozen=True)
class Approval:
    """One call that needs (or needed) a person's approval."""

    task_id: str
    run_id: str
    name: str
    queue: str
    #: The tool's declared effect (a ToolEffect value): a write, always.
    effect: str
    state: ApprovalState
    #: When the worker parked it (unix seconds).
    requested_at: float
    #: The call's arguments as ``tooleffect_privacy`` lets the audit show them.
    arguments: Mapping[str, str] = field(default_factory=dict)
    #: The worker that parked it.
    worker: str = ""
    #: The message as the broker delivered it; published again once decided.
    message: MessageEnvelope | None = None
    decided_by: str = ""
    decided_at: float | None = None
    reason: str = ""
    #: Who approves it (an Approver value): what its tool declared for it.
    approver: str = "operator"
    #: The digest of what the agent's user was shown when deciding it
    #: (:func:`~celery_tooleffect.actions.showing.shown_arguments`): a
    #: delivery whose arguments show otherwise does not run.
    shown_digest: str = ""
    #: Who of the agent's side decided, and how (the SDK or MCP).
    user_decided_by: str = ""

    @property
    def decided(self) -> bool:
        """Whether the decision it waited for is taken (a call its user
        approved still waits for an operator)."""
        return self.state not in (ApprovalState.PENDING, ApprovalState.ABSENT,
                                  ApprovalState.USER_APPROVED)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form, without the message (what the CLI and the API show)."""
        return {
            "task_id": self.task_id,
            "run_id": self.run_id,
            "name": self.name,
            "queue": self.queue,
            "effect": self.effect,
            "state": self.state.value,
            "requested_at": self.requested_at,
            "arguments": dict(self.arguments),
            "worker": self.worker,
            "decided_by": self.decided_by,
            "decided_at": self.decided_at,
            "reason": self.reason,
            "approver": self.approver,
            "user_decided_by": self.user_decided_by,
            "shown_digest": self.shown_digest,
        }

    def record(self) -> dict[str, str]:
        """The fields of its Redis hash."""
        fields = {
            "state": self.state.value,
            "task_id": self.task_id,
            "run_id": self.run_id,
            "name": self.name,
            "queue": self.queue,
            "effect": self.effect,
            "requested_at": f"{self.requested_at:.6f}",
            "arguments": json.dumps(dict(self.arguments), ensure_ascii=False),
            "worker": self.worker,
            "approver": self.approver,
        }
        for name in ("shown_digest", "user_decided_by", "decided_by", "reason"):
            if getattr(self, name):
                fields[name] = getattr(self, name)
        if self.decided_at is not None:
            fields["decided_at"] = f"{self.decided_at:.6f}"
        if self.message is not None:
            fields["message"] = json.dumps(self.message.to_dict(), ensure_ascii=False)
        return fields

    @classmethod
    def from_record(cls, record: Mapping[str, str]) -> Approval:
        message = record.get("message")
        decided_at = record.get("decided_at")
        return cls(
            task_id=record.get("task_id", ""),
            run_id=record.get("run_id", ""),
            name=record.get("name", ""),
            queue=record.get("queue", ""),
            effect=record.get("effect", ""),
            state=ApprovalState.coerce(record.get("state", "absent")),
            requested_at=float(record.get("requested_at") or 0),
            arguments=json.loads(record.get("arguments") or "{}"),
            worker=record.get("worker", ""),
            message=MessageEnvelope.from_dict(json.loads(message)) if message else None,
            decided_by=record.get("decided_by", ""),
            decided_at=float(decided_at) if decided_at else None,
            reason=record.get("reason", ""),
            approver=record.get("approver") or "operator",
            shown_digest=record.get("shown_digest", ""),
            user_decided_by=record.get("user_decided_by", ""),
        )


@dataclass(frozen=True)
class ApprovalMove:
    """The answer of :meth:`ApprovalStore.transition`; true when the record moved."""

    moved: bool
    #: The state the record was in when the script ran.
    previous: ApprovalState

    def __bool__(self) -> bool:
        return self.moved


@dataclass(frozen=True)
class DecidedPage:
    """One page of :meth:`ApprovalStore.decided`: the calls decided so, newest
    decision first, and how many are listed so in all (on any page)."""

    approvals: list[Approval]
    total: int


class ApprovalStore:
    """Approval records and their indexes, each step atomic with its audit event."""

    def __init__(self, settings: Settings, audit: AuditLog) -> None:
        self.settings = settings
        self.audit = audit
        self.keys = Keys(settings.key_prefix)

    @property
    def client(self) -> redis.Redis:
        return client_for(self.settings.store_endpoint, self.settings.socket_timeout)

    def _keys(self, run_id: str, task_id: str) -> list[str]:
        return [self.keys.approval(run_id, task_id), self.keys.run_events(run_id)]

    def _index(self, approval: Approval) -> list[tuple[Any, ...]]:
        return [
            ("ZADD", self.keys.approvals_pending, "NX", f"{approval.requested_at:.6f}",
             approval.task_id),
            ("HSET", self.keys.approvals_where, approval.task_id, approval.run_id),
        ]

    # -- the worker ------------------------------------------------------------

    def request(self, approval: Approval, event: AuditEvent) -> ApprovalState | None:
        """Park ``approval`` (state ``pending``) with its ``approval requested``
        event; None when parked now, else the state of the record it already
        has (nothing changes then, but the indexes are repaired). A record its
        user approved before it was published (``user_approved``, no message)
        takes this delivery's message and is listed for an operator: None too.

        Raises :class:`StoreUnavailable` when it could not be stored.
        """
        record = flatten(approval.record())
        fields = self.audit.sealed(event)
        answer = self._store(approval, record, fields, ApprovalState.USER_APPROVED.value,
                             also=self._index(approval))
        if text(answer[0]) in ("ok", "adopted"):
            return None
        return ApprovalState.coerce(text(answer[1]))

    def record_decision(self, approval: Approval, event: AuditEvent) -> ApprovalState | None:
        """Store a decision the agent's user took before the call was published
        (``approval``: no message, in its decided state) with its audit event;
        None when stored now, else the state of the record the call already has
        (then nothing changes). The first record wins, as a worker's parking.

        Raises :class:`StoreUnavailable` when it could not be stored.
        """
        record = flatten(approval.record())
        fields = self.audit.sealed(event)
        answer = self._store(approval, record, fields, "", also=[
            ("HSET", self.keys.approvals_where, approval.task_id, approval.run_id)])
        if text(answer[0]) == "ok":
            if approval.state in DECISIONS and approval.decided_at is not None:
                self.index_decision(approval, approval.state, approval.decided_at)
            return None
        return ApprovalState.coerce(text(answer[1]))

    def _store(self, approval: Approval, record: list[Any], fields: list[Any], adopt: str,
               also: list[tuple[Any, ...]]) -> Any:
        try:
            return script("approval_request").call_with(
                self.client, self._keys(approval.run_id, approval.task_id),
                [self.settings.approval_ttl, self.settings.run_stream_maxlen, adopt,
                 len(record) // 2, *record, *fields],
                also=[*also, self.audit.global_copy(fields)],
            )
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc

    def decision(self, run_id: str, task_id: str) -> tuple[ApprovalState, str]:
        """Where the call's approval stands (``absent``: never parked nor
        decided) and the digest of what its user was shown ('' if none).

        Raises :class:`StoreUnavailable` when the store cannot answer.
        """
        try:
            state, digest = self.client.hmget(self.keys.approval(run_id, task_id),
                                              ["state", "shown_digest"])
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc
        return (ApprovalState.coerce(text(state)) if state else ApprovalState.ABSENT,
                text(digest) if digest else "")

    def state(self, run_id: str, task_id: str) -> ApprovalState:
        """Where the call's approval stands (``absent``: never parked).

        Raises :class:`StoreUnavailable` when the store cannot answer.
        """
        try:
            value = self.client.hget(self.keys.approval(run_id, task_id), "state")
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc
        return ApprovalState.coerce(text(value)) if value else ApprovalState.ABSENT

    # -- decisions -------------------------------------------------------------

    def transition(
        self, approval: Approval, *, new_state: ApprovalState,
        allowed: frozenset[ApprovalState], event: AuditEvent,
        fields: Mapping[str, str] | None = None,
    ) -> ApprovalMove:
        """Move the record to ``new_state`` from one of ``allowed``, with ``event``,
        atomically; false (nothing changed) when it is in another state.

        A decision (``new_state`` in :data:`DECISIONS`) that moved the record is
        then listed by it (:meth:`index_decision`, at ``fields["decided_at"]``).

        Raises :class:`StoreUnavailable` when nothing could be stored.
        """
        record = flatten(fields or {})
        event_fields = self.audit.sealed(event)
        try:
            answer = script("approval_transition").call_with(
                self.client, self._keys(approval.run_id, approval.task_id),
                [approval_argument(allowed), new_state.value, self.settings.approval_ttl,
                 self.settings.run_stream_maxlen, len(record) // 2, *record, *event_fields],
                also=[self.audit.global_copy(event_fields)],
            )
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc
        move = ApprovalMove(text(answer[0]) == "ok", ApprovalState.coerce(text(answer[1])))
        if move and new_state in DECISIONS:
            decided_at = _seconds((fields or {}).get("decided_at")) or time.time()
            self.index_decision(approval, new_state, decided_at)
        return move

    def _decided_keys(self, state: ApprovalState, queue: str, tool: str) -> list[str]:
        decided = self.keys.approvals_decided
        return [decided(state.value), decided(state.value, queue=queue),
                decided(state.value, tool=tool), decided(state.value, queue=queue, tool=tool)]

    def index_decision(self, approval: Approval, state: ApprovalState,
                       decided_at: float) -> bool:
        """List ``approval`` as decided ``state`` at ``decided_at`` (unix seconds)
        for ``tooleffect_approval_retention``: one round trip that adds it to its
        four decided indexes, trims them of decisions past the retention and
        sets them to expire with the newest. Idempotent. Never raises: False
        when the store refused (the decision stands, and is not listed by it).
        """
        retention = self.settings.approval_retention
        horizon = f"({time.time() - retention:.6f}"
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key in self._decided_keys(state, approval.queue, approval.name):
                    pipe.zadd(key, {approval.task_id: decided_at})
                    pipe.zremrangebyscore(key, "-inf", horizon)
                    pipe.expire(key, max(math.ceil(retention), 1))
                pipe.execute()
        except redis.RedisError as exc:
            logger.warning("%s[%s] was %s, but is not listed as such (%s: %s)",
                           approval.name, approval.task_id, state.value,
                           type(exc).__name__, exc)
            return False
        return True

    def is_listed(self, task_id: str) -> bool:
        """Whether the call is on the pending index (awaiting a decision or its publication)."""
        try:
            return self.client.zscore(self.keys.approvals_pending, task_id) is not None
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc

    def unlist(self, task_id: str) -> None:
        """Take a decided (and published) call off the pending index."""
        try:
            self.client.zrem(self.keys.approvals_pending, task_id)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc

    # -- reading ---------------------------------------------------------------

    def get(self, task_id: str) -> Approval | None:
        """The call's record, whatever its state; None when there is none."""
        try:
            run_id = self.client.hget(self.keys.approvals_where, task_id)
            if run_id is None:
                return None
            record = self.client.hgetall(self.keys.approval(text(run_id), task_id))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc
        if not record:
            return None
        return Approval.from_record({text(k): text(v) for k, v in record.items()})

    def listed(self, *, older_than: float | None = None) -> list[Approval]:
        """Every call on the pending index, oldest first (those parked before
        ``older_than``, unix seconds, when given): awaiting a decision, or
        decided and not yet published."""
        client = self.client
        try:
            task_ids = [text(task_id) for task_id in client.zrangebyscore(
                self.keys.approvals_pending, "-inf",
                f"({older_than:.6f}" if older_than is not None else "+inf",
            ) if isinstance(task_id, (bytes, str))]
            if not task_ids:
                return []
            # Three round trips in all, however many are listed: the index,
            # then the records (_records).
            return self._records(client, task_ids)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc

    def _records(self, client: redis.Redis, task_ids: list[str]) -> list[Approval]:
        """The records of ``task_ids`` in that order, those still stored: two
        round trips (their run ids, then every record in one pipeline)."""
        located = [(task_id, text(run_id)) for task_id, run_id in zip(
            task_ids, client.hmget(self.keys.approvals_where, task_ids), strict=True)
            if run_id is not None]
        with client.pipeline(transaction=False) as pipe:
            for task_id, run_id in located:
                pipe.hgetall(self.keys.approval(run_id, task_id))
            records = pipe.execute()
        return [Approval.from_record({text(k): text(v) for k, v in record.items()})
                for record in records if record]

    def decided(self, state: ApprovalState | str, *, queue: str | None = None,
                tool: str | None = None, limit: int = 50, offset: int = 0,
                now: float | None = None) -> DecidedPage:
        """The calls decided ``state`` (approved, rejected, expired) within the last
        ``tooleffect_approval_retention`` seconds, newest decision first, of
        ``queue`` and ``tool`` when given: ``limit`` of them from ``offset``.

        Whether or not their message was published again since: the record as
        it is now (a rejected or expired call a worker ended is ``ended``).
        Entries whose record is gone, or was parked again since (a replay of
        the task after its record expired), are skipped; ``total`` counts them.
        Three round trips, reading only this page's entries. Raises
        :class:`StoreUnavailable` when the store does not answer.
        """
        wanted = ApprovalState.coerce(state)
        if wanted not in DECISIONS:
            raise ValueError(f"not a decision: {wanted.value!r} (one of "
                             f"{', '.join(sorted(d.value for d in DECISIONS))})")
        key = self.keys.approvals_decided(
            wanted.value, queue=queue or None, tool=tool or None)
        since = f"{(time.time() if now is None else now) - self.settings.approval_retention:.6f}"
        client = self.client
        try:
            with client.pipeline(transaction=False) as pipe:
                pipe.zrevrangebyscore(key, "+inf", since, start=offset, num=limit)
                pipe.zcount(key, since, "+inf")
                members, total = pipe.execute()
            task_ids = [text(member) for member in members]
            if not task_ids:
                return DecidedPage([], int(total))
            found = self._records(client, task_ids)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"approval store unavailable: {exc}") from exc
        return DecidedPage(
            [approval for approval in found
             if approval.state is wanted
             or (approval.state is ApprovalState.ENDED and wanted in END_REFUSED_FROM)],
            int(total),
        )

    def pending_counts(self) -> Counter[tuple[str, str]]:
        """How many calls await a decision, by (queue, tool) (a call its user
        approved, waiting for an operator, too)."""
        return Counter((approval.queue, approval.name) for approval in self.listed()
                       if approval.state in (ApprovalState.PENDING,
                                             ApprovalState.USER_APPROVED))


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def overdue_before(settings: Settings, now: float | None = None) -> float:
    """Calls parked before this time (unix seconds) are past ``tooleffect_approval_timeout``."""
    return (time.time() if now is None else now) - settings.approval_timeout
