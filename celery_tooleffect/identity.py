"""A call's identity: its task id, bound to its tool and a digest of its arguments.

Pure functions, the same in a producer, a worker and a tool's body:

- :func:`call_digest` is what the journal and the publish-time claim compare:
  the same for the arguments a producer passed and for the arguments a
  worker decoded from the message, whatever the serializer
  (:func:`publish_digest` gets there by a round trip through it);
- :func:`call_task_id` turns an agent's own tool-call id (and its run) into a
  task id, so that a call re-sent after any crash is the same call;
- :data:`RUN_ID_HEADER` and :data:`CALL_ID_HEADER` name the message headers
  that carry a call's run and its agent's call id, :data:`CALLER_HEADER`
  who made it;
- :func:`child_task_id` gives a tool called inside another tool's body an id
  derived from its parent, so that a parent that runs again never runs a
  finished child again.

See ``docs/identity.md`` for the rules a user relies on.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import pickle
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kombu.serialization import dumps, loads

from .errors import InvalidCallId

#: The longest call id or step key accepted (an agent's tool-call id is a
#: few dozen characters; a longer one is a mistake, not an id).
MAX_ID_LENGTH = 200

#: The namespace of the ids derived here (UUID version 5: a name-based id).
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://celery-tooleffect.dev/call-identity")

#: The message header of the run a call belongs to, set by a producer
#: (``run_id=``) or carried from a parent call; without it a call's run is its
#: root id.
RUN_ID_HEADER = "tooleffect_run_id"
#: The agent's own id of a tool call published with ``call_id=``
#: (informational: the task id derived from it is the call's identity).
CALL_ID_HEADER = "tooleffect_call_id"
#: Who made the call, as the agent runtime that published it authenticated
#: them (the MCP server: compact JSON naming how, and the token's issuer,
#: subject and client id). Recorded in every audit event of the call
#: (``details.caller``). Informational: whoever may publish to the broker
#: may set it, as any header, and nothing is decided by it (docs/agents.md,
#: "Who called").
CALLER_HEADER = "tooleffect_caller"
#: The longest caller header recorded; a longer one is cut.
MAX_CALLER_LENGTH = 1024


def checked_id(value: Any, what: str) -> str:
    """``value`` if it can be an id (a non-empty text of at most
    :data:`MAX_ID_LENGTH` characters); raises :class:`InvalidCallId` otherwise."""
    if not isinstance(value, str):
        raise InvalidCallId(f"{what} must be text, not {type(value).__name__}")
    if not value:
        raise InvalidCallId(f"{what} is empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidCallId(
            f"{what} is {len(value)} characters long (at most {MAX_ID_LENGTH}): {value[:40]!r}..."
        )
    return value


def joined(*parts: str) -> str:
    """The parts of a derived id as one text that no other parts give.

    Parts without a newline are joined by newlines, as every release has done,
    so the ids of those parts never change (a resend after an upgrade is the
    same call). Parts of which one holds a newline would be ambiguous so
    (``"b\\nc", "a"`` and ``"c", "a\\nb"`` give one text): they are written
    as a JSON array after a mark instead, which holds no newline, so it never
    equals a joined text, and equals another only for the same parts.
    """
    if not any("\n" in part for part in parts):
        return "\n".join(parts)
    return "\x00json:" + json.dumps(list(parts))


def call_task_id(call_id: str, run_id: str = "") -> str:
    """The task id of the agent's tool call ``call_id`` in run ``run_id``.

    The same for the same pair, whoever computes it and however often, and
    different for another pair: a UUID (version 5), as Celery's ids are UUIDs.
    """
    return str(uuid.uuid5(NAMESPACE, joined("call", run_id, call_id)))


def child_task_id(parent_task_id: str, child: str, key: str) -> str:
    """The task id of tool ``child`` called in the body of task ``parent_task_id``.

    ``key`` is the child's ordinal among the calls of ``child`` in this
    attempt of the parent (``"#1"``, ``"#2"`` ...) or the step key the body
    gave it (``"@charge"``).
    """
    return str(uuid.uuid5(NAMESPACE, joined("child", parent_task_id, child, key)))


def call_digest(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The digest of a call's arguments as a worker decoded them (32 hex digits).

    Positional arguments compare as a list (a tuple and a list are the same),
    keyword arguments regardless of their order. Values JSON can show are
    compared by a canonical JSON text (dates, decimals, UUIDs, bytes and sets
    tagged by type); a call with anything else (pickle-only objects) is
    compared by its pickle.
    """
    try:
        canonical = json.dumps(
            [list(args), dict(kwargs)], sort_keys=True, separators=(",", ":"),
            ensure_ascii=False, default=_tagged, allow_nan=True,
        ).encode()
    except (TypeError, ValueError):
        canonical = b"pickle:" + pickle.dumps((list(args), dict(kwargs)), protocol=4)
    return hashlib.sha256(canonical).hexdigest()[:32]


def publish_digest(args: Sequence[Any], kwargs: Mapping[str, Any], serializer: str) -> str:
    """:func:`call_digest` of the arguments as a worker will decode them.

    The arguments go through ``serializer`` and back first, so that a digest
    taken before publishing equals the one the worker takes. Raises kombu's
    ``EncodeError``, as Celery's publish does, when ``serializer`` cannot
    encode them.
    """
    body = [list(args), dict(kwargs)]
    content_type, encoding, data = dumps(body, serializer=serializer)  # type: ignore[no-untyped-call]
    decoded = loads(  # type: ignore[no-untyped-call]
        data, content_type, encoding, accept={content_type}, force=True)
    return call_digest(decoded[0], decoded[1])


def conflict_text(task_id: str, tool: str, recorded_tool: str, conflict: str) -> str:
    """What a :class:`CallIdConflict` says, wherever it is found."""
    if conflict == "tool":
        return (f"task id {task_id!r} belongs to a call of {recorded_tool}, not of {tool}: "
                "a call id names one call; give this one its own")
    return (f"task id {task_id!r} belongs to a call of {tool} with other arguments: "
            "a call id names one call; give this one its own")


def _tagged(value: Any) -> Any:
    """A JSON form of the values kombu's serializers carry besides JSON's own."""
    if isinstance(value, datetime.datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, datetime.date):
        return {"$date": value.isoformat()}
    if isinstance(value, datetime.time):
        return {"$time": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {"$decimal": str(value)}
    if isinstance(value, uuid.UUID):
        return {"$uuid": str(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, (set, frozenset)):
        return {"$set": sorted(json.dumps(item, sort_keys=True, default=_tagged)
                               for item in value)}
    raise TypeError(f"{type(value).__name__} has no canonical JSON form")
