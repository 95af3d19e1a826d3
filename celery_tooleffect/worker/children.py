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
attempt, or give them step keys.

Not covered: a canvas (chain, group, chord) published from a body keeps the
ids Celery froze for it (its results and callbacks are bound to them before
it is sent), and a tool called on another thread than the body's has no
parent. Both can be given ids with :meth:`ParentCall.child_id`
(``.set(task_id=...)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from ..identity import checked_id, child_task_id


@dataclass
class ParentCall:
    """The tool call whose body is running on this thread (this attempt of it)."""

    task_id: str
    run_id: str
    #: Calls of each child tool made so far in this attempt.
    ordinals: dict[str, int] = field(default_factory=dict)

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
def body_of(task_id: str, run_id: str) -> Iterator[ParentCall]:
    """Make the call ``task_id`` of run ``run_id`` the parent of the tools its
    body calls, for as long as the body runs (a fresh ordinal count each attempt)."""
    token = _parent.set(ParentCall(task_id, run_id))
    try:
        yield _parent.get()  # type: ignore[misc]
    finally:
        _parent.reset(token)
