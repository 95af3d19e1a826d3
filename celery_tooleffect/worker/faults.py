"""Crash points for testing tools: a worker armed with ``TOOLEFFECT_CRASH_AT``
SIGKILLs itself at one boundary of an attempt, once.

:mod:`celery_tooleffect.pytest_plugin` starts ``celery worker`` subprocesses
with ``TOOLEFFECT_CRASH_AT=<boundary>[@<tool name>]`` and
``TOOLEFFECT_CRASH_MARK=<file>``; the first attempt (of that tool) that
reaches the boundary creates the file and kills the whole worker (its process
group: main process and pool), as a power cut or an OOM kill would; the mark
keeps any later attempt from crashing again. The boundaries, in the order an
attempt meets them:

``before_intent``
    a write before its lease and intent are recorded (a read: before its body);
``after_intent``
    a write whose intent is recorded, before its body (a read: before its body);
``in_body``
    the body was called (its side effect not made yet);
``before_outcome``
    the body returned (its side effect made), the outcome not recorded;
``before_ack``
    the outcome and Celery's result are stored, the message not acknowledged
    (in the worker's main process).

Unarmed (no ``TOOLEFFECT_CRASH_AT``, read once at import), a crash point is one
comparison.
"""

from __future__ import annotations

import os
import signal

BOUNDARIES = ("before_intent", "after_intent", "in_body", "before_outcome", "before_ack")

_SPEC = os.environ.get("TOOLEFFECT_CRASH_AT") or None
_MARK = os.environ.get("TOOLEFFECT_CRASH_MARK") or ""


def _parse(spec: str | None) -> tuple[str, str] | None:
    if spec is None:
        return None
    boundary, _, tool = spec.partition("@")
    if boundary not in BOUNDARIES:
        raise ValueError(f"TOOLEFFECT_CRASH_AT: not a boundary: {boundary!r} "
                         f"(one of {', '.join(BOUNDARIES)})")
    return boundary, tool


_ARMED = _parse(_SPEC)


def crash_point(boundary: str, tool: str) -> None:
    """SIGKILL this worker here if it is armed for ``boundary`` (and ``tool``), once."""
    if _ARMED is None:
        return
    armed_boundary, armed_tool = _ARMED
    if boundary != armed_boundary or (armed_tool and armed_tool != tool):
        return
    if _MARK:
        try:
            os.close(os.open(_MARK, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # crashed once already
    os.killpg(os.getpgid(0), signal.SIGKILL)
