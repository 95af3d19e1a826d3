"""Asking a tool's reconciler whether a write that may have run took effect.

A tool declares a reconciler with ``reconcile=`` or ``@tool.reconciler``
(see :mod:`celery_tooleffect.reconciliation`). :func:`reconciler_of` finds
it; :func:`ask_reconciler` calls it with a time limit and promises an answer
that is a :class:`~celery_tooleffect.reconciliation.Reconciliation`, or none
and why. Called by the worker when it finds a write interrupted
(``worker/execution.py``), by the worker's main process deciding how to end
a lost call (``worker/request.py``), and by the operators' ``dlq reconcile``
(``admin/operations/``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from celery.app.task import Context

from ..errors import ReconcileFailed
from ..reconciliation import Reconciliation


def reconciler_of(tool: Any) -> Callable[..., Any] | None:
    """The tool's ``reconcile``, if it declares one
    (see :mod:`celery_tooleffect.reconciliation`)."""
    check = getattr(tool, "reconcile", None)
    return check if callable(check) else None


def ask_reconciler(
    check: Callable[..., Any], tool: Any, request: Context, args: tuple[Any, ...],
    kwargs: dict[str, Any], *, timeout: float,
) -> tuple[Reconciliation | None, BaseException | None]:
    """Call ``check(*args, **kwargs)`` for at most ``timeout`` seconds: its
    answer, or None and why there is none (it raised, timed out, or answered
    something that is not a :class:`Reconciliation`).

    It runs on a thread of its own, which sees the call's request (Celery
    keeps ``task.request`` per thread), so ``self.idempotency_key`` works in
    it. A call that outlives its timeout is left to finish on its daemon
    thread; its answer is ignored.
    """
    answers: list[Any] = []

    def call() -> None:
        tool.request_stack.push(request)
        try:
            answers.append(check(*args, **kwargs))
        except BaseException as exc:
            answers.append(exc)
        finally:
            tool.request_stack.pop()

    thread = threading.Thread(target=call, name="tooleffect-reconcile", daemon=True)
    thread.start()
    thread.join(timeout)
    if not answers:
        return None, ReconcileFailed(f"reconcile did not answer within {timeout:g}s")
    answer = answers[0]
    if isinstance(answer, Reconciliation):
        return answer, None
    if isinstance(answer, BaseException):
        return None, answer
    return None, ReconcileFailed(
        f"reconcile answered {type(answer).__name__}, not a Reconciliation "
        "(Reconciliation.applied / not_applied / unknown)"
    )
