"""The side effect a tool declares, and how a tool name resolves to one.

The effect is a property of the *code*: a tool declares it with the ``effect``
option of ``@app.task``, a class attribute, or a ``get_effect()`` method.
Nothing in configuration can change it (see :mod:`celery_tooleffect.task` for
where relabelling is refused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .choices import Choice

if TYPE_CHECKING:
    from celery import Celery


class ToolEffect(Choice):
    """What running a tool does to the world outside it."""

    __choice_name__ = "a tool effect"

    READ_ONLY = "read_only"
    IDEMPOTENT_WRITE = "idempotent_write"
    NON_IDEMPOTENT_WRITE = "non_idempotent_write"

    @property
    def is_write(self) -> bool:
        """True for both kinds of write: they keep a journal and fail closed."""
        return self is not ToolEffect.READ_ONLY

    @property
    def safe_to_retry(self) -> bool:
        """False only for NON_IDEMPOTENT_WRITE: running it twice doubles its effect."""
        return self is not ToolEffect.NON_IDEMPOTENT_WRITE

    @property
    def strictness(self) -> int:
        """0 for READ_ONLY, 1 for IDEMPOTENT_WRITE, 2 for NON_IDEMPOTENT_WRITE: the
        order in which "the strictest effect wins" (``begin_attempt.lua`` ranks
        the values the same way)."""
        return _STRICTNESS[self]

    @classmethod
    def strictest(cls, *effects: ToolEffect | str | None) -> ToolEffect:
        """The strictest of ``effects`` (members or values; None and '' are
        skipped, so a journal entry without an effect changes nothing).
        A value that is no effect counts as NON_IDEMPOTENT_WRITE, as an unknown
        tool does. Raises ``ValueError`` when nothing is given."""
        known = [cls._rank(effect) for effect in effects if effect]
        if not known:
            raise ValueError("strictest() of no effect")
        return max(known, key=lambda effect: effect.strictness)

    @classmethod
    def _rank(cls, effect: ToolEffect | str) -> ToolEffect:
        try:
            return cls.coerce(effect)
        except ValueError:
            return cls.NON_IDEMPOTENT_WRITE

    def mcp_annotations(self, *, open_world: bool = True) -> dict[str, bool]:
        """The MCP tool annotations matching this effect (always all four hints).

        A write may overwrite or delete, so both writes are ``destructiveHint``;
        only READ_ONLY is ``readOnlyHint``. ``openWorldHint`` is true unless the
        tool says it touches nothing outside itself.
        """
        return {
            "readOnlyHint": self is ToolEffect.READ_ONLY,
            "idempotentHint": self.safe_to_retry,
            "destructiveHint": self.is_write,
            "openWorldHint": open_world,
        }


_STRICTNESS = {
    ToolEffect.READ_ONLY: 0,
    ToolEffect.IDEMPOTENT_WRITE: 1,
    ToolEffect.NON_IDEMPOTENT_WRITE: 2,
}


@runtime_checkable
class ToolEffectInterface(Protocol):
    """A tool that computes its effect in code rather than by attribute."""

    def get_effect(self) -> ToolEffect: ...


class ToolEffectResolver:
    """Resolves the effect of a tool by name from an app's task registry.

    An unknown name (a stale tool referenced by a persisted step, a typo, a
    message for a task this worker does not have) resolves to
    NON_IDEMPOTENT_WRITE: the class that is audit-critical and never retried.
    """

    UNKNOWN_TOOL_EFFECT = ToolEffect.NON_IDEMPOTENT_WRITE

    def __init__(self, app: Celery) -> None:
        self.app = app

    def effect_for(self, name: str) -> ToolEffect:
        """The effect of the registered task ``name``; the worst case if unknown."""
        task = self.app.tasks.get(name)
        if task is None:
            return self.UNKNOWN_TOOL_EFFECT
        return self.effect_for_tool(task)

    @staticmethod
    def effect_for_tool(task: Any) -> ToolEffect:
        """The effect a task object declares; READ_ONLY when it declares nothing."""
        get_effect = getattr(task, "get_effect", None)
        if callable(get_effect):
            return ToolEffect.coerce(get_effect())
        declared = getattr(task, "effect", None)
        if declared is None:
            return ToolEffect.READ_ONLY
        return ToolEffect.coerce(declared)
