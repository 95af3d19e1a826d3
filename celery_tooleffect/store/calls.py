"""Publish-time claims of task ids: the first line against a reused call id.

A producer that chooses a task id (``task_id=``, ``call_id=``, or a tool
called in another tool's body, whose id is derived from its parent) claims it
before publishing: one script, one round trip, and only then. The claim binds
the id to the tool and the digest of the arguments
(:mod:`celery_tooleffect.identity`), so that another call under the same id
is refused before it is sent and never reads the first call's result. The
worker's journal checks the same binding again (``begin_attempt.lua``), for
messages whose producer did not claim.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from ..errors import StoreUnavailable
from ..settings import Settings
from .audit import text
from .connections import client_for
from .keys import Keys
from .lua import script


@dataclass(frozen=True)
class Claim:
    """The answer of :meth:`CallClaims.claim`; true unless it is a conflict."""

    #: 'claimed', 'same' or 'conflict'.
    verdict: str
    #: For a conflict: 'tool' or 'arguments'.
    conflict: str = ""
    #: For a conflict: the tool the task id belongs to.
    recorded_tool: str = ""

    def __bool__(self) -> bool:
        return self.verdict != "conflict"


class CallClaims:
    """The claims of task ids in the store's Redis."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)

    @property
    def client(self) -> redis.Redis:
        return client_for(self.settings.store_endpoint, self.settings.socket_timeout)

    def claim(self, task_id: str, tool: str, digest: str) -> Claim:
        """Claim ``task_id`` for a call of ``tool`` whose arguments digest to
        ``digest``. Raises :class:`StoreUnavailable` when the store did not
        answer: a producer that cannot tell whether an id is free does not
        publish under it."""
        try:
            answer = script("claim_call")(
                self.client, [self.keys.call_claim(task_id)],
                [tool, digest, self.settings.journal_ttl],
            )
        except redis.RedisError as exc:
            raise StoreUnavailable(f"call claims unavailable: {exc}") from exc
        parts = [text(part) for part in answer]
        return Claim(parts[0], *parts[1:3])

    def tool(self, task_id: str) -> str | None:
        """The tool ``task_id`` was claimed for (None: never claimed, or the
        claim expired). Raises :class:`StoreUnavailable` when the store did
        not answer."""
        try:
            recorded = self.client.hget(self.keys.call_claim(task_id), "tool")
        except redis.RedisError as exc:
            raise StoreUnavailable(f"call claims unavailable: {exc}") from exc
        return None if recorded is None else text(recorded)
