"""What passes between the worker's main process and the pool process that runs a
tool call: one typed record each way, and the pool's own notes of the attempt.

Celery's prefork pool runs a task in a child process. What reaches the child is
the request dict the main process built from the message (pickled with the
job); Celery's tracer turns it into the task's ``Context`` (``task.request``),
whose ``headers`` then hold every field Celery does not know. What comes back
is what the tracer returns (``fast_trace_task`` in ``celery/app/trace.py``): on
success only ``repr`` of the result; on a failure the ``ExceptionInfo`` of the
exception, pickled. So:

- **main → pool**: :class:`Handoff`, under one key of the request dict
  (:data:`HANDOFF_FIELD`): the attempt's owner token, the reserved headers the
  producer set, whether the store approved the call, whether the pool
  acknowledges a success. Made by ``ToolRequest`` (the approval gate adds the
  approval), read by ``Execution``; :func:`hide_handoff` takes it out of the
  request's ``headers`` (what a body reads or returns, what a republish
  carries on).
- **pool → main**: :class:`PendingLetter`, a dead letter a tool decided, which
  only the process that holds the message can store. When Celery's result is
  the tool's own error, Celery's tracer handles the failure and returns the
  ``ExceptionInfo`` it made: the ``task_failure`` handler (``worker/signals.py``),
  which runs after the result was stored, moves the letter onto it
  (:func:`send_letter`). When the result is the package's ``DeadLettered``, the
  tracer handles it as a ``Reject``: no handler runs, and only the exception
  crosses, so the letter rides on it (``DeadLettered.pending_letter``).
  ``ToolRequest`` takes it from either with :func:`take_letter`, which removes
  it, so that it never reaches a result backend. Nothing comes back on success:
  the main process decided beforehand (``Handoff.ack_in_pool``) that the pool
  acknowledges it.
- **in the pool**: :class:`AttemptNotes`, what the pool process learns while it
  runs the attempt (the fencing token, whether it acknowledged the message, the
  letter waiting for the ``ExceptionInfo``, the error ``self.retry()`` raised
  with the budget spent, the error already audited), one attribute of the
  request (:func:`attempt_notes`); it never leaves the process. The same notes
  serve a call run in any other process (``apply()``, eager) and the
  approval gate's refusal in the main process, for what reads them in that
  process: nothing is marked on an exception, which would travel with it
  (to the main process, to a result backend).

Nothing else crosses. What the main process keeps of a delivery
(``ToolRequest``'s ``_tooleffect_*`` attributes) and marks on kombu's
message (``worker/strategy.py``) stay in the main process; the
``failure_class`` an interactive call's error is given is for its caller,
in the process that called it (the main process classifies every failure
the pool sends it again, with the same classifier).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from billiard.einfo import ExceptionInfo

from ..errors import DeadLettered
from ..store.dead_letter_record import DeadLetter
from .children import current_parent

#: The request-dict key (and so the ``task.request`` attribute) of the
#: :class:`Handoff`. Never taken from a message: a producer's header of this
#: name (or :data:`NOTES_FIELD`'s) is refused as forged, as any ``tooleffect_*``
#: header it may not set, and replaced before anything reads it.
HANDOFF_FIELD = "tooleffect_handoff"
#: The ``task.request`` attribute of the pool's :class:`AttemptNotes`.
NOTES_FIELD = "tooleffect_notes"
#: The ``ExceptionInfo`` attribute a :class:`PendingLetter` rides on.
LETTER_FIELD = "tooleffect_pending_letter"


# -- main process -> pool process ----------------------------------------------------


@dataclass(frozen=True)
class Handoff:
    """What the worker's main process tells the pool process about one delivery."""

    #: The attempt's owner token, made where the message is held: the journal
    #: entry the pool begins is the one the main process may end.
    token: str
    #: The ``tooleffect_*`` headers the producer set that it may not set,
    #: found before this record was added: the pool dead-letters the call.
    forged: tuple[str, ...] = ()
    #: The store says a person approved this call (the approval gate asked).
    approved: bool = False
    #: The pool process acknowledges the message on success (the broker is the
    #: store's Redis): with the outcome's script, or alone once Celery stored
    #: the result. The main process then sends nothing.
    ack_in_pool: bool = False


def handoff_of(request: Any) -> Handoff | None:
    """The :class:`Handoff` of ``request`` (``task.request``); None for a call no
    worker's main process handed over (``apply()``, a direct call), whatever
    its headers say."""
    handoff = getattr(request, HANDOFF_FIELD, None)
    return handoff if isinstance(handoff, Handoff) else None


def hide_handoff(request: Any) -> None:
    """Take the :class:`Handoff` out of ``request.headers``, keeping the
    attribute :func:`handoff_of` reads. Celery's ``Context`` copies every
    request field it does not know into ``headers`` (``_get_custom_headers``):
    what a task reads as its custom headers, returns (a result backend must
    serialize it) or passes on to a signature made from the request
    (``Context.as_execution_options``, every retry and republish). The
    Handoff is none of these. Called first thing in the pool process
    (``ToolTask.__call__``) and on every republish from a request, in either
    process (``ToolTask.signature_from_request``)."""
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and HANDOFF_FIELD in headers:
        request.headers = {name: value for name, value in headers.items()
                           if name != HANDOFF_FIELD} or None


# -- in the pool process -------------------------------------------------------------


@dataclass
class AttemptNotes:
    """What the process that runs one attempt (the pool process, or the
    caller's for ``apply()``) learns while it runs it, for what reads it later
    in the same process: ``ToolTask.fencing_token`` in the body, the failure
    handling (``worker/endings.py``), the acknowledgement after Celery stored
    the result (``ToolTask.after_return``), and the ``task_failure`` handler.
    Never sent anywhere."""

    #: The write's fencing token, once its intent is recorded.
    fencing_token: int | None = None
    #: The message is acknowledged (by the outcome's script, or alone).
    acknowledged: bool = False
    #: A letter decided with the tool's own error as Celery's result, until the
    #: ``task_failure`` handler moves it onto the ``ExceptionInfo``.
    letter: PendingLetter | None = None
    #: ``self.retry()`` found the retry budget spent: what it raised (Celery
    #: raises the tool's ``exc``, or ``MaxRetriesExceededError``) and the
    #: budget. Only that very error ends the attempt as RETRIES_EXHAUSTED.
    retries_spent: tuple[BaseException, int] | None = None
    #: A failure the package audited already (an interactive call's error, an
    #: approval refused): the ``task_failure`` handler does not audit it again.
    audited: BaseException | None = None
    #: True while a write's ``self.retry()`` runs Celery's ``Task.retry``: its
    #: publish is held (``ToolTask.apply_async``) in :attr:`held_retry`, and
    #: sent once the journal leaves 'running' (worker/execution.py). Published
    #: at once, the retry could begin while its own attempt still runs: deferred
    #: for the attempt's lease, or refused as a conflict when its arguments
    #: changed.
    holding_retry: bool = False
    #: The retry ``self.retry()`` asked for and Celery built: the arguments of
    #: its ``apply_async``, not sent yet.
    held_retry: HeldRetry | None = None


@dataclass(frozen=True)
class HeldRetry:
    """A retry's publish, held until its attempt's outcome is recorded."""

    args: Any
    kwargs: Any
    options: dict[str, Any]


@contextlib.contextmanager
def holding_retry(request: Any) -> Iterator[None]:
    """Hold what Celery's ``Task.retry`` publishes while it runs in a write's
    own body (:func:`hold_retry`; worker/execution.py sends it once the attempt
    has ended). Anywhere else (a read, a handler after the body) nothing is held."""
    notes = existing_notes(request)
    parent = current_parent()
    if (notes is None or notes.fencing_token is None
            or parent is None or parent.task_id != request.id):
        yield
        return
    notes.holding_retry = True
    try:
        yield
    finally:
        notes.holding_retry = False


def hold_retry(request: Any, args: Any, kwargs: Any, options: dict[str, Any]) -> bool:
    """Keep the publish of a retry that :func:`holding_retry` holds: True when kept."""
    notes = existing_notes(request)
    if notes is None or not notes.holding_retry:
        return False
    notes.held_retry = HeldRetry(args, kwargs, options)
    return True


def attempt_notes(request: Any) -> AttemptNotes:
    """The :class:`AttemptNotes` of the attempt ``request`` (``task.request``)
    runs, made on first use."""
    notes = existing_notes(request)
    if notes is None:
        notes = AttemptNotes()
        setattr(request, NOTES_FIELD, notes)
    return notes


def existing_notes(request: Any) -> AttemptNotes | None:
    """The :class:`AttemptNotes` of ``request`` if its attempt made any (reading
    never makes them: outside a call ``task.request`` is a shared default)."""
    notes = getattr(request, NOTES_FIELD, None)
    return notes if isinstance(notes, AttemptNotes) else None


# -- pool process -> main process ----------------------------------------------------


@dataclass(frozen=True)
class PendingLetter:
    """A dead letter decided by a tool, on its way to the process that holds the
    message, which adds the message and stores it
    (:func:`~celery_tooleffect.worker.letters.finish_dead_letter`)."""

    #: The letter, without its message (the process that holds it adds it).
    letter: DeadLetter
    #: The call's journal entry is ``dead_lettering``: finishing moves it on.
    journalled: bool
    #: The task id's Celery result is another call's (a call-id conflict): the
    #: letter is stored and the result left alone.
    keep_result: bool = False


def hand_over(request: Any, rejection: DeadLettered) -> BaseException:
    """What the pool process raises for ``rejection``, a dead letter its tool
    decided: ``rejection`` itself, which carries its letter, when it is
    Celery's result; else the tool's own error (``rejection.error``), with the
    letter noted for :func:`send_letter`."""
    letter = rejection.pending_letter
    if rejection.error is None or not isinstance(letter, PendingLetter) or letter.keep_result:
        return rejection
    attempt_notes(request).letter = letter
    return rejection.error


def send_letter(request: Any, einfo: Any) -> bool:
    """Move the letter noted for the attempt of ``request`` (:func:`hand_over`)
    onto ``einfo``, the ``ExceptionInfo`` Celery's tracer returns to the
    worker's main process; whether there was one. Called by the
    ``task_failure`` handler, after Celery stored the result."""
    notes = existing_notes(request)
    if notes is None or notes.letter is None:
        return False
    einfo.__dict__[LETTER_FIELD], notes.letter = notes.letter, None
    return True


def take_letter(exc_info: Any, exc: BaseException) -> PendingLetter | None:
    """In the worker's main process: the letter a tool decided for this failure,
    taken off what carried it (``exc_info``, or ``exc`` when it is the
    ``DeadLettered``); None when the tool decided none."""
    letter = exc_info.__dict__.pop(LETTER_FIELD, None)
    if isinstance(exc, DeadLettered):
        carried, exc.pending_letter = exc.pending_letter, None
        letter = letter or carried
    return letter if isinstance(letter, PendingLetter) else None


def exception_info(exc: BaseException) -> ExceptionInfo:
    """Billiard's ``ExceptionInfo`` of ``exc`` (with its traceback), as the pool
    process sends a failure and Celery's failure handlers take it: for the
    endings the main process decides itself."""
    try:
        raise exc
    except BaseException:
        return ExceptionInfo()
