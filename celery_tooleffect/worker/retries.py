"""How a tool runs again: one retry budget per tool, and one decision.

Every way a tool can run again by itself counts against the same budget, the
number of *retries* after the first attempt:

- a failure the classifier calls retryable, or one the tool lists in Celery's
  ``autoretry_for`` (never one in ``dont_autoretry_for``);
- an interruption: a pool child killed, a hard time limit, a whole worker
  lost (its lease lapsed);
- a retry the tool asks for itself with ``self.retry()``.

The budget is the tool's own ``max_retries`` when the tool declares one (the
``@app.task(max_retries=...)`` option, a class attribute, or
``retry_kwargs={"max_retries": ...}``), else the app's
``tooleffect_max_retries``. Celery's "retry forever" (``max_retries=None``) is
refused: an interrupted or failing tool must end as a dead letter some day. A
``self.retry(max_retries=n)`` may lower the budget for that call, never raise it.

A NON_IDEMPOTENT_WRITE is never retried after its body started, except when
the tool asks (``self.retry()``) or its exception is marked ``NoSideEffect``;
``autoretry_for`` on it is refused when the task is bound (:func:`refuse_autoretry`).

The countdown of a retry for an ``autoretry_for`` failure is Celery's: the
``countdown`` in ``retry_kwargs``, else Celery's exponential backoff when
``retry_backoff`` is set (``retry_backoff_max``, ``retry_jitter``), else the
package's backoff. Every other retry the package decides waits the package's
backoff (``tooleffect_backoff_base``/``tooleffect_backoff_cap``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task
from celery.utils.time import get_exponential_backoff_interval

from ..effect import ToolEffect
from ..errors import ToolDeclarationError
from ..failures import FailureClass, is_no_side_effect
from ..settings import Settings
from ..store.states import Ending

_UNSET = object()


@dataclass(frozen=True)
class Decision:
    """What :meth:`RetryPolicy.after_failure` decided for a failed attempt."""

    retry: bool
    #: Seconds to wait before the retry runs (0 when not retried).
    countdown: float = 0.0
    #: Why it is not retried although the failure is retryable: the budget is spent.
    exhausted: bool = False


@dataclass(frozen=True)
class RetryPolicy:
    """The retry budget and backoff of one tool."""

    budget: int
    effect: ToolEffect
    settings: Settings
    autoretry_for: tuple[type[BaseException], ...] = ()
    dont_autoretry_for: tuple[type[BaseException], ...] = ()
    retry_backoff: float = 0.0
    retry_backoff_max: int = 600
    retry_jitter: bool = True
    autoretry_countdown: float | None = None

    @classmethod
    def of(cls, task: Any, settings: Settings, effect: ToolEffect) -> RetryPolicy:
        """The policy a tool declares (see the module docstring for the rules)."""
        retry_kwargs = dict(getattr(task, "retry_kwargs", None) or {})
        countdown = retry_kwargs.get("countdown")
        return cls(
            budget=budget_of(task, settings),
            effect=effect,
            settings=settings,
            autoretry_for=tuple(getattr(task, "autoretry_for", ()) or ()),
            dont_autoretry_for=tuple(getattr(task, "dont_autoretry_for", ()) or ()),
            retry_backoff=float(getattr(task, "retry_backoff", False) or 0),
            retry_backoff_max=int(getattr(task, "retry_backoff_max", 600)),
            retry_jitter=bool(getattr(task, "retry_jitter", True)),
            autoretry_countdown=None if countdown is None else float(countdown),
        )

    @property
    def attempts_allowed(self) -> int:
        """How many attempts the journal lets a write begin: the first and its retries."""
        return self.budget + 1

    def after_failure(
        self, exc: BaseException, failure_class: FailureClass, *, retries: int,
        attempt: int, body_started: bool,
    ) -> Decision:
        """Retry ``exc`` or not; ``retries`` is how many retries came before this
        attempt, ``attempt`` its number (the journal's for a write)."""
        if isinstance(exc, self.dont_autoretry_for):
            return Decision(retry=False)
        autoretried = bool(self.autoretry_for) and isinstance(exc, self.autoretry_for)
        if not (failure_class.retryable or autoretried):
            return Decision(retry=False)
        # A write that may have happened is not run again by a failure.
        if body_started and not self.effect.safe_to_retry and not is_no_side_effect(exc):
            return Decision(retry=False)
        if attempt > self.budget:
            return Decision(retry=False, exhausted=True)
        return Decision(retry=True, countdown=self.countdown(retries, autoretried=autoretried))

    def countdown(self, retries: int, *, autoretried: bool = False) -> float:
        """Seconds before the next attempt, after ``retries`` retries."""
        if autoretried and self.autoretry_countdown is not None:
            return self.autoretry_countdown
        if autoretried and self.retry_backoff:
            return float(get_exponential_backoff_interval(
                factor=int(max(1.0, self.retry_backoff)), retries=retries,
                maximum=self.retry_backoff_max, full_jitter=self.retry_jitter,
            ))
        return self.settings.backoff(retries)

    def longest_countdown(self) -> float:
        """The longest wait this policy can give a retry (for the start-up checks)."""
        if self.autoretry_for and self.autoretry_countdown is not None:
            return max(self.autoretry_countdown, self.settings.backoff_cap)
        if self.autoretry_for and self.retry_backoff:
            return max(float(self.retry_backoff_max), self.settings.backoff_cap)
        return self.settings.backoff_cap


def budget_of(task: Any, settings: Settings) -> int:
    """The tool's retry budget: its own ``max_retries``, else ``tooleffect_max_retries``."""
    declared, value = declared_max_retries(task)
    if not declared:
        return settings.max_retries
    refuse_unbounded_retries(task)
    return int(value)


def refuse_unbounded_retries(task: Any) -> None:
    """Refuse Celery's "retry forever" (``max_retries=None``) on a tool."""
    declared, value = declared_max_retries(task)
    if declared and value is None:
        raise ToolDeclarationError(
            f"{getattr(task, 'name', task)}: max_retries=None (retry forever) is refused on a "
            "tool: give it a number; a tool that keeps failing or being interrupted ends as "
            "a dead letter once its budget is spent"
        )


def declared_max_retries(task: Any) -> tuple[bool, Any]:
    """Whether a tool (instance or class) declares ``max_retries``, and what.

    Declared: in ``retry_kwargs``, or by a class below Celery's ``Task`` (the
    ``@app.task`` option, a class attribute, an annotation). Celery's own
    ``Task.max_retries`` (3) is a default, not a declaration.
    """
    retry_kwargs = getattr(task, "retry_kwargs", None) or {}
    if "max_retries" in retry_kwargs:
        return True, retry_kwargs["max_retries"]
    for klass in (task if isinstance(task, type) else type(task)).__mro__:
        if klass is Task:
            break
        value = klass.__dict__.get("max_retries", _UNSET)
        # ToolTask's own is a property that answers the tool's budget.
        if value is not _UNSET and not isinstance(value, property):
            return True, value
    return False, None


def refuse_autoretry(task_cls: Any, effect: ToolEffect) -> None:
    """Refuse Celery's ``autoretry_for`` on a NON_IDEMPOTENT_WRITE.

    An automatic retry runs again a write that may have happened: the failure
    it retries can come after the write.
    """
    autoretry_for = tuple(getattr(task_cls, "autoretry_for", ()) or ())
    if autoretry_for and effect is ToolEffect.NON_IDEMPOTENT_WRITE:
        names = ", ".join(getattr(kind, "__name__", str(kind)) for kind in autoretry_for)
        raise ToolDeclarationError(
            f"{task_cls.name}: autoretry_for=({names}) is refused on a NON_IDEMPOTENT_WRITE: "
            "a retry would run again a write that may have happened. For errors raised "
            "before the write, raise them marked NoSideEffect (the package retries those); "
            "if running the tool twice is harmless, declare effect=IDEMPOTENT_WRITE; "
            "to retry by your own decision, call self.retry() in the body"
        )


def exhausted_text(
    name: str, task_id: str, *, attempts: int, budget: int, endings: Mapping[Ending, int],
) -> str:
    """What spent a tool's retry budget, in words (for a dead letter's error)."""
    said = {
        Ending.FAILED: "failed with a retryable error",
        Ending.INTERRUPTED: "interrupted (worker lost, pool child killed or time limit)",
        Ending.REQUESTED: "ended by a retry the tool asked for (self.retry())",
    }
    parts = [f"{count} {said[ending]}" for ending, count in endings.items() if count]
    how = "; ".join(parts) if parts else "earlier attempts"
    return (
        f"{name}[{task_id}] not run again: its retry budget of {budget} is spent after "
        f"{attempts} attempt(s): {how}"
    )
