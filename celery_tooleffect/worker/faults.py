"""Crash points for testing tools: a worker armed with ``TOOLEFFECT_CRASH_AT``
SIGKILLs itself at one boundary of an attempt, once; one armed with
``TOOLEFFECT_STORE_FAULT_AT`` makes its store refuse writes there instead.

:mod:`celery_tooleffect.pytest_plugin` starts ``celery worker`` subprocesses
with ``TOOLEFFECT_CRASH_AT=<boundary>[@<tool name>]`` and
``TOOLEFFECT_CRASH_MARK=<file>``; the first attempt (of that tool) that
reaches the boundary creates the file and kills the whole worker (its process
group: main process and pool), as a power cut or an OOM kill would; the mark
keeps any later attempt from crashing again. With
``TOOLEFFECT_CRASH_PROCESS=pool`` only the pool process running the attempt is
killed, and the worker's main process handles the lost child as it would an
OOM kill. The boundaries, in the order an attempt meets them:

``before_intent``
    a write before its lease and intent are recorded (a read: before its body);
``after_intent``
    a write whose intent is recorded, before its body (a read: before its body);
``in_body``
    the body was called (its side effect not made yet);
``before_outcome``
    the body returned (its side effect made), the outcome not recorded;
``before_ack``
    the outcome and Celery's result are stored, the worker's main process has
    not acknowledged the message yet (when the broker is the store's Redis the
    pool process acknowledged it with the outcome, and this comes after).

``TOOLEFFECT_STORE_FAULT_AT=<boundary>[@<tool name>]`` with
``TOOLEFFECT_STORE_FAULT_URL`` (a Redis of the test's own, the worker's
``tooleffect_redis_url``) and a mark file of its own: at that boundary, once,
the store is made to refuse every write (``maxmemory 1``, ``noeviction``), as
a full Redis does; the test makes it accept writes again.

Unarmed (neither variable, read once at import), a crash point is one
comparison.
"""

from __future__ import annotations

import os
import signal

BOUNDARIES = ("before_intent", "after_intent", "in_body", "before_outcome", "before_ack")

_SPEC = os.environ.get("TOOLEFFECT_CRASH_AT") or None
_MARK = os.environ.get("TOOLEFFECT_CRASH_MARK") or ""
#: ``worker`` (default): the whole worker dies; ``pool``: only the pool process
#: running the attempt (``before_ack`` happens in the main process: the worker).
_PROCESS = os.environ.get("TOOLEFFECT_CRASH_PROCESS") or "worker"


def _parse(spec: str | None) -> tuple[str, str] | None:
    if spec is None:
        return None
    boundary, _, tool = spec.partition("@")
    if boundary not in BOUNDARIES:
        raise ValueError(f"TOOLEFFECT_CRASH_AT: not a boundary: {boundary!r} "
                         f"(one of {', '.join(BOUNDARIES)})")
    return boundary, tool


_ARMED = _parse(_SPEC)
_STORE_FAULT = _parse(os.environ.get("TOOLEFFECT_STORE_FAULT_AT") or None)
_STORE_URL = os.environ.get("TOOLEFFECT_STORE_FAULT_URL") or ""
_STORE_MARK = os.environ.get("TOOLEFFECT_STORE_FAULT_MARK") or ""


def crash_point(boundary: str, tool: str) -> None:
    """SIGKILL this worker here if it is armed for ``boundary`` (and ``tool``),
    once; or make the store refuse writes here, once."""
    if _ARMED is None and _STORE_FAULT is None:
        return
    if _matches(_STORE_FAULT, boundary, tool) and _first(_STORE_MARK):
        import redis

        store = redis.Redis.from_url(_STORE_URL, socket_timeout=5)
        store.config_set("maxmemory-policy", "noeviction")
        store.config_set("maxmemory", "1")
        store.close()
    if _matches(_ARMED, boundary, tool) and _first(_MARK):
        if _PROCESS == "pool" and boundary != "before_ack":
            os.kill(os.getpid(), signal.SIGKILL)  # the pool process; the worker lives on
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _matches(armed: tuple[str, str] | None, boundary: str, tool: str) -> bool:
    return armed is not None and armed[0] == boundary and armed[1] in ("", tool)


def _first(mark: str) -> bool:
    """Whether this is the first time (the mark file did not exist; now it does)."""
    if not mark:
        return True
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
