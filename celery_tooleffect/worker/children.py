"""Tools called inside another tool's body take their identity from it.

While a tool's body runs, :func:`body_of` makes it the *parent* of every tool
its body calls on the same thread: directly (``charge(...)``), with
``.apply()``, or published with ``.delay()`` / ``.apply_async()``. Each such
child gets a task id derived from the parent's task id, the child's name and
its ordinal among this attempt's calls of that child (or the ``step=`` key
the body gave it; :func:`celery_tooleffect.identity.child_task_id`), and runs
in the parent's run. A parent that runs again (a retry, a redelivery, a
replay, a reconciled write found not applied) therefore calls the same
children under the same ids, and the journal does not run a finished child
again. The rule for a body: call its children in the same order on every
attempt, or give them step keys. A finished child called interactively
(``charge(...)``, ``.apply()``) answers its parent's next attempt with the
result its journal entry kept (:func:`keep_result_in_journal`,
:func:`kept_result`).

Not covered: a canvas (chain, group, chord) published from a body keeps the
ids Celery froze for it (its results and callbacks are bound to them before
it is sent), and a tool called on another thread than the body's has no
parent. Both can be given ids with :meth:`ParentCall.child_id`
(``.set(task_id=...)``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kombu.serialization import dumps, loads

from ..identity import checked_id, child_task_id
from ..store.journal import Begin

logger = logging.getLogger(__name__)


@dataclass
class ParentCall:
    """The tool call whose body is running on this thread (this attempt of it)."""

    task_id: str
    run_id: str
    #: Calls of each child tool made so far in this attempt.
    ordinals: dict[str, int] = field(default_factory=dict)
    #: Who made the parent call (its ``tooleffect_caller``): its children's too.
    caller: str = ""

    def child_id(self, child: str, step: str | None = None) -> str:
        """The task id of the next call of tool ``child`` (or of its call with
        step key ``step``) from this body."""
        if step is not None:
            key = "@" + checked_id(step, "step")
        else:
            ordinal = self.ordinals.get(child, 0) + 1
            self.ordinals[child] = ordinal
            key = f"#{ordinal}"
        return child_task_id(self.task_id, child, key)


_parent: ContextVar[ParentCall | None] = ContextVar("tooleffect_parent", default=None)


def current_parent() -> ParentCall | None:
    """The call whose body runs on this thread, if any."""
    return _parent.get()


@contextlib.contextmanager
def body_of(task_id: str, run_id: str, caller: str = "") -> Iterator[ParentCall]:
    """Make the call ``task_id`` of run ``run_id`` (made by ``caller``) the
    parent of the tools its body calls, for as long as the body runs (a fresh
    ordinal count each attempt)."""
    token = _parent.set(ParentCall(task_id, run_id, caller=caller))
    try:
        yield _parent.get()  # type: ignore[misc]
    finally:
        _parent.reset(token)


@dataclass(frozen=True)
class KeptResult:
    """What beginning an interactive call that ended before answers (a tool
    called in a tool's body whose parent runs again): its kept result."""

    value: Any


def keep_result_in_journal(tool: Any, result: Any, label: str) -> dict[str, str] | None:
    """The journal fields that keep an interactive call's ``result`` (encoded
    with the app's result serializer): a tool called in a tool's body answers
    with it when its parent runs again (:func:`kept_result`). None when the
    serializer cannot encode it: a call again then answers without it."""
    serializer = getattr(getattr(tool, "app", None), "conf", {}).get(
        "result_serializer") or "json"
    try:
        content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
            result, serializer=serializer)
    except Exception as exc:
        logger.info("%s: result not kept (%s): a call again answers without it", label, exc)
        return None
    text = data.decode("latin-1") if isinstance(data, bytes) else data
    return {"result": text, "result_type": f"{content_type} {encoding}"}


def kept_result(begin: Begin) -> Any:
    """The result :func:`keep_result_in_journal` kept, as ``begin_attempt`` answered it."""
    content_type, _, encoding = begin.kept_content_type.partition(" ")
    # Kept as text: a binary encoding went through latin-1.
    kept = begin.kept_result.decode("utf-8")
    data: bytes | str = kept if encoding == "utf-8" else kept.encode("latin-1")
    return loads(  # type: ignore[no-untyped-call]
        data, content_type, encoding, accept={content_type}, force=True)
