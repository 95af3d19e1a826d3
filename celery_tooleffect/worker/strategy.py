"""The worker-side checks of a tool's task message, before anything runs.

Celery's default strategy (``celery.worker.strategy.default``) turns a message
into a ``Request`` on the consumer's thread. It trusts the message's shape: a
body that is valid JSON but not ``[args, kwargs, embed]`` (``1``, ``"x"``,
``[1]``), or a header of the wrong type (``timelimit: "x"``, ``id: {}``,
``stamped_headers: 5``) raises a ``TypeError`` or ``ValueError`` there or
later in ``execute_using_pool``. Those are not the errors Celery's consumer
catches (``InvalidTaskError``, ``ContentDisallowed``, ``DecodeError``), so the
error leaves the event loop and **the worker stops** ("Unrecoverable error");
the message is still in kombu's ``unacked`` hash, so it is restored and stops
the next worker too. Other shapes get through and fail in the pool (``kwargs``
that is a list, ``retries: "abc"``, an integer ``id``), where the message is
rejected without a dead letter; a malformed ``callbacks`` or ``chain`` fails
*after* the body ran, so a write that succeeded is reported as FAILURE.

``ToolTask`` therefore uses :func:`tool_strategy`, and ``ToolRequest`` calls
:func:`message_problems` once the request is built. A message that fails
either check raises ``InvalidTaskError``, which Celery's consumer hands to
``on_invalid_task``, where the package's consumer step dead-letters it
(``malformed_message``, class ``client_error``) before it is dropped.

The strategy also hands the request the consumer's way to run a callback on
the thread that owns the connection (:func:`in_the_loop`): the pool process
acknowledges a tool's message with its outcome, and only kombu's bookkeeping
in the worker is left, which must not run on a threads pool's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from celery.exceptions import InvalidTaskError
from celery.worker.strategy import default
from kombu.exceptions import ContentDisallowed, DecodeError

from ..identity import RUN_ID_HEADER

#: Headers Celery reads that must be text when present (None is allowed).
_TEXT_HEADERS = ("id", "task", "shadow", "root_id", "parent_id", "group", RUN_ID_HEADER)

#: The attribute ``ToolRequest`` sets on the kombu message it was built from,
#: once built and checked (kombu's ``Message`` keeps a ``__dict__`` for such).
#: Not part of the hand-off (``worker/handoff.py``): kombu's message lives in
#: the worker's main process only, where it is set and read; the pool process
#: never sees it.
BUILT_MARK = "_tooleffect_request_built"


def mark_built(message: Any) -> None:
    """Called by ``ToolRequest`` once it is built and checked for ``message``:
    an error :func:`tool_strategy` meets after this is not about its shape."""
    setattr(message, BUILT_MARK, True)


#: The attribute :func:`tool_strategy` sets on each kombu message: the
#: consumer's ``call_soon_ack``. In the main process only, as :data:`BUILT_MARK`.
IN_THE_LOOP = "_tooleffect_in_the_loop"


def in_the_loop(message: Any) -> Callable[..., Any]:
    """How to run ``callback(*args)`` for ``message`` on the thread that owns its
    channel, as Celery runs an acknowledgement: the consumer's ``call_soon_ack``,
    which on an event loop (prefork, threads, solo) queues it there and wakes
    the loop when called from another thread (the loop then fetches at once if
    the acknowledgement freed prefetch room), and without one (gevent, eventlet)
    runs it at once. A message no strategy saw (a request built by hand) gets
    a direct call."""
    schedule: Callable[..., Any] | None = getattr(message, IN_THE_LOOP, None)
    return schedule if schedule is not None else _call


def _call(callback: Callable[..., Any], *args: Any) -> Any:
    return callback(*args)


def tool_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """Celery's default strategy, whose shape errors become ``InvalidTaskError``.

    Only errors raised before the request was built are converted (an error
    after that is not about the message's shape, and is left to Celery): the
    request marks its message once built (:func:`mark_built`).
    """
    handler = default(task, app, consumer, **kwargs)
    schedule = getattr(consumer, "call_soon_ack", None)

    def tool_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                             **options: Any) -> Any:
        if schedule is not None:
            setattr(message, IN_THE_LOOP, schedule)
        try:
            return handler(message, body, ack, reject, callbacks, **options)
        except (InvalidTaskError, ContentDisallowed, DecodeError):
            raise
        except Exception as exc:
            if getattr(message, BUILT_MARK, False):
                raise
            raise InvalidTaskError(
                f"unreadable task message: {type(exc).__name__}: {exc}"
            ) from exc

    return tool_message_handler


def message_problems(request_dict: Mapping[str, Any], payload: Any) -> list[str]:
    """What in a built request's headers or body a worker cannot run (empty: nothing)."""
    problems = []
    for name in _TEXT_HEADERS:
        value = request_dict.get(name)
        if value is not None and not isinstance(value, str):
            problems.append(f"header {name!r} must be text, not {type(value).__name__}")
    if not request_dict.get("id"):
        problems.append("the message has no task id")
    if RUN_ID_HEADER in request_dict and not request_dict.get(RUN_ID_HEADER):
        problems.append(f"header {RUN_ID_HEADER!r} is empty")
    retries = request_dict.get("retries")
    if retries is not None and (
        isinstance(retries, bool) or not isinstance(retries, int) or retries < 0
    ):
        problems.append(f"header 'retries' must be a count, not {retries!r:.40}")
    timelimit = request_dict.get("timelimit")
    if timelimit is not None and not (
        isinstance(timelimit, (list, tuple)) and len(timelimit) == 2
        and all(_is_number(limit) or limit is None for limit in timelimit)
    ):
        problems.append(f"header 'timelimit' must be [soft, hard] seconds, not {timelimit!r:.40}")
    stamped = request_dict.get("stamped_headers")
    if stamped is not None and not (
        isinstance(stamped, (list, tuple)) and all(isinstance(h, str) for h in stamped)
    ):
        problems.append("header 'stamped_headers' must be a list of names")
    stamps = request_dict.get("stamps")
    if stamps is not None and not isinstance(stamps, Mapping):
        problems.append("header 'stamps' must be a mapping")
    ignore_result = request_dict.get("ignore_result")
    if ignore_result is not None and not isinstance(ignore_result, bool):
        problems.append("header 'ignore_result' must be true or false")
    problems.extend(_body_problems(payload))
    return problems


def _body_problems(payload: Any) -> list[str]:
    if not (isinstance(payload, (list, tuple)) and len(payload) == 3):
        return ["the body must be [args, kwargs, embed]"]
    args, kwargs, embed = payload
    problems = []
    if not isinstance(args, (list, tuple)):
        problems.append(f"args must be a list, not {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        problems.append(f"kwargs must be a mapping, not {type(kwargs).__name__}")
    elif not all(isinstance(key, str) for key in kwargs):
        problems.append("kwargs names must be text")
    if not isinstance(embed, Mapping):
        return [*problems, f"embed must be a mapping, not {type(embed).__name__}"]
    for name in ("callbacks", "errbacks", "chain"):
        value = embed.get(name)
        if value is not None and not (
            isinstance(value, (list, tuple)) and all(isinstance(item, Mapping) for item in value)
        ):
            problems.append(f"embed {name!r} must be a list of signatures")
    chord = embed.get("chord")
    if chord is not None and not isinstance(chord, Mapping):
        problems.append("embed 'chord' must be a signature")
    return problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_request(request_dict: Mapping[str, Any], payload: Any) -> None:
    """Raise ``InvalidTaskError`` when :func:`message_problems` finds anything."""
    problems = message_problems(request_dict, payload)
    if problems:
        raise InvalidTaskError("invalid task message: " + "; ".join(problems))
