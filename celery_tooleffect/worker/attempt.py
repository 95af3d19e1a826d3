"""One attempt of a tool call: who runs it, for which run, under which token.

Built the same way in the pool process (from ``task.request``) and in the
worker's main process (from the ``Request``), so both address the same journal
entry and run's audit events.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..effect import ToolEffect
from ..identity import CALL_ID_HEADER, CALLER_HEADER, MAX_CALLER_LENGTH, RUN_ID_HEADER, joined
from ..store.audit import StepContext, worker_identity
from ..store.envelope import REPLAY_HEADER
from ..store.journal import JournalRef
from ..store.rollback import SENT_AT_HEADER

#: Set on every republish of a task from its own request (a retry, a
#: deferral, ``ToolTask.signature_from_request``): the call may have run
#: before, under another release's effect. It only makes a READ_ONLY worker
#: ask the journal (one read), so a producer that sets it grants nothing.
AGAIN_HEADER = "tooleffect_again"
#: The ``tooleffect_*`` message headers a producer may set: the run id, the
#: agent's call id, who made the call (informational: recorded in the audit
#: events, deciding nothing), the mark a dead-letter replay leaves (informational:
#: workers decide from the journal, so setting it grants nothing), the mark of
#: a republish and the time a message was sent.
ALLOWED_HEADERS = frozenset({RUN_ID_HEADER, CALL_ID_HEADER, CALLER_HEADER, REPLAY_HEADER,
                             AGAIN_HEADER, SENT_AT_HEADER})
#: The option ``ToolTask.signature_from_request`` adds: a republish of a task
#: from its own request (a retry, a deferral), which claims no id.
REPUBLISH_OPTION = "_tooleffect_republish"


_tokens: dict[int, tuple[str, Iterator[int]]] = {}


def new_token() -> str:
    """An owner token no other attempt has: this process's random prefix and a count.

    One random draw per process, not per call: a token is made for every
    delivery on the worker's main process. A forked child draws its own.
    """
    pid = os.getpid()
    source = _tokens.get(pid)
    if source is None:
        source = _tokens.setdefault(pid, (uuid.uuid4().hex[:20], itertools.count(1)))
    prefix, counter = source
    return f"{prefix}{next(counter):012x}"


def forged_headers(headers: Mapping[str, Any]) -> list[str]:
    """``tooleffect_*`` headers a producer is not allowed to set."""
    # The first letter is looked at before anything is lowered: this runs on
    # every message, on the worker's main process.
    return sorted(
        name
        for name in headers
        if isinstance(name, str) and name[:1] in "tT"
        and name.lower().startswith("tooleffect_") and name not in ALLOWED_HEADERS
    )


def resolve_run_id(fields: Mapping[str, Any], task_id: str) -> str:
    """The run a call belongs to: the producer's run header, else its root id."""
    nested = fields.get("headers")
    for source in (fields, nested if isinstance(nested, Mapping) else {}):
        value = source.get(RUN_ID_HEADER)
        if value:
            return str(value)
    return str(fields.get("root_id") or task_id)


def caller_of(fields: Mapping[str, Any]) -> str:
    """Who made the call, as its ``tooleffect_caller`` header says ('' when it
    says nothing, or nothing that is text); cut to ``MAX_CALLER_LENGTH``."""
    nested = fields.get("headers")
    for source in (fields, nested if isinstance(nested, Mapping) else {}):
        value = source.get(CALLER_HEADER)
        if isinstance(value, str) and value:
            return value[:MAX_CALLER_LENGTH]
    return ""


def sent_at_of(fields: Mapping[str, Any]) -> float | None:
    """When the message was published (its ``tooleffect_sent_at`` header), or
    None when it does not say (a producer that did not stamp it)."""
    nested = fields.get("headers")
    for source in (fields, nested if isinstance(nested, Mapping) else {}):
        value = source.get(SENT_AT_HEADER)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def queue_name(delivery_info: Mapping[str, Any] | None, default: str) -> str:
    """The queue a message came from (its routing key on the default exchange)."""
    info = delivery_info or {}
    return str(info.get("routing_key") or info.get("queue") or default)


@dataclass(frozen=True)
class Attempt:
    """Everything the journal, audit and dead letters need about one attempt."""

    task_id: str
    run_id: str
    name: str
    effect: ToolEffect
    queue: str
    token: str
    redelivered: bool
    interactive: bool
    retries: int
    #: Whether this delivery may not be the call's first: redelivered by the
    #: broker, a retry, a deferral or a replay (:func:`delivered_again`).
    again: bool = False
    #: When its message was published (None: the message does not say, or an
    #: interactive call): see :mod:`celery_tooleffect.store.rollback`.
    sent_at: float | None = None
    #: Who made the call (:func:`caller_of`), recorded in its audit events.
    caller: str = ""

    @classmethod
    def of(
        cls,
        fields: Mapping[str, Any],
        *,
        task_id: str,
        name: str,
        effect: ToolEffect,
        delivery_info: Mapping[str, Any] | None,
        default_queue: str,
        token: str,
        interactive: bool = False,
        retries: int = 0,
    ) -> Attempt:
        """The attempt of a delivery, from its request ``fields``: the one builder,
        used by the pool process, the worker's main process and the consumer."""
        return cls(
            task_id=task_id,
            run_id=resolve_run_id(fields, task_id),
            name=name,
            effect=effect,
            queue=queue_name(delivery_info, default_queue),
            token=token,
            redelivered=bool((delivery_info or {}).get("redelivered")),
            interactive=interactive,
            retries=retries,
            again=delivered_again(fields, delivery_info, retries),
            sent_at=None if interactive else sent_at_of(fields),
            caller=caller_of(fields),
        )

    @property
    def idempotency_key(self) -> str:
        """The task's idempotency key (:func:`idempotency_key`)."""
        return idempotency_key(self.run_id, self.task_id)

    @property
    def ref(self) -> JournalRef:
        return JournalRef(self.run_id, self.task_id)

    @property
    def context(self) -> StepContext:
        return StepContext(
            run_id=self.run_id,
            task_id=self.task_id,
            tool=self.name,
            effect=self.effect,
            queue=self.queue,
            redelivered=self.redelivered,
            worker=worker_identity(),
            caller=self.caller,
        )


def handled_as(attempt: Attempt, recorded: ToolEffect | str | None) -> Attempt:
    """``attempt`` under the effect its call is handled as: the strictest of the
    one its tool declares here and ``recorded``, the one its journal entry
    records (a release that declares the tool stricter recorded it; the
    strictest effect wins, docs/identity.md). A recorded name that is no
    effect counts as the strictest, as in ``begin_attempt.lua``; None or ''
    (no entry, or none recorded) changes nothing. The one place this is
    decided, for the pool process and the worker's main process."""
    effect = ToolEffect.strictest(attempt.effect, recorded)
    return attempt if effect is attempt.effect else replace(attempt, effect=effect)


def delivered_again(fields: Mapping[str, Any], delivery_info: Mapping[str, Any] | None,
                    retries: int) -> bool:
    """Whether a delivery may not be its call's first: the broker redelivered
    it (kombu's Redis restore and RabbitMQ set ``redelivered``), Celery's
    ``retries`` counts a retry, or the package republished it (a deferral:
    :data:`AGAIN_HEADER`; a replay: ``REPLAY_HEADER``). A first delivery is
    none of these: a read pays no journal read for it."""
    return bool(
        (delivery_info or {}).get("redelivered") or retries > 0
        or fields.get(AGAIN_HEADER) or fields.get(REPLAY_HEADER)
    )


def idempotency_key(run_id: str, task_id: str) -> str:
    """A task's idempotency key: the same for every delivery, retry and replay
    of the task, different for another task (or the same task id in another
    run). SHA-256 of the run id and the task id, 32 hex digits."""
    digest = hashlib.sha256(joined(run_id, task_id).encode("utf-8", "replace"))
    return digest.hexdigest()[:32]
