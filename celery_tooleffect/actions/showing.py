"""What the people who approve a call are shown of its arguments, and its digest.

One function, :func:`show_call`, for everyone who shows a call or checks
what was shown: the operators' pages and CLI (from the kept message), the
agent adapters and the MCP server (from the arguments before they publish),
and the worker's approval gate (from the delivered message). The same call
shows the same values whoever shows it, so its digest binds a decision to
exactly the arguments the person saw: a delivery whose arguments show
otherwise does not run on that decision.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..store.envelope import shown as json_safe


@dataclass(frozen=True)
class Shown:
    """What a person deciding a call is shown of its arguments: the arguments
    themselves (JSON-safe), or, when the tool declares an ``approval_view``,
    what that view returns (a card number masked, say). When nothing can be
    shown, ``problem`` says why, and the call can still be decided."""

    #: Positional and keyword arguments, JSON-safe (None: not shown).
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None
    #: What the tool's ``approval_view`` returned, instead of the arguments.
    view: dict[str, Any] | None = None
    #: Why nothing is shown (a body the accepted serializers cannot decode,
    #: an ``approval_view`` that raised, a tool this app does not know).
    problem: str = ""

    @property
    def digest(self) -> str:
        """SHA-256 of what is shown (canonical JSON): a decision is bound to it."""
        return hashlib.sha256(canonical(self.values()).encode("utf-8")).hexdigest()

    def values(self) -> dict[str, Any]:
        """What is shown, as one JSON-safe mapping (what the digest is over)."""
        if self.view is not None:
            return {"view": self.view}
        return {"args": self.args, "kwargs": self.kwargs, "problem": self.problem or None}


def show_call(task: Any, args: Any, kwargs: Any) -> Shown:
    """What is shown of a call of ``task`` with ``args`` and ``kwargs``: its
    ``approval_view``'s answer when it declares one, else the arguments;
    never raises for what the view does (then nothing of them is shown)."""
    view = getattr(type(task), "approval_view", None)
    if view is None:
        return Shown(args=json_safe(list(args or ())), kwargs=json_safe(dict(kwargs or {})))
    try:
        answer = view(task, *(args or ()), **(kwargs or {}))
        if not isinstance(answer, Mapping):
            raise TypeError(f"it returned {type(answer).__name__}, not a mapping")
    except Exception as exc:
        return Shown(problem=f"the tool's approval_view raised {type(exc).__name__}: {exc}; "
                             "the arguments are hidden")
    return Shown(view=json_safe(dict(answer)))


def canonical(value: Any) -> str:
    """``value`` as canonical JSON (sorted keys, no spaces): what a digest is over."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
