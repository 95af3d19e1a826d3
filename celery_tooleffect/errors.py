"""Every exception the package raises, under one base, each saying what went
wrong and what it means::

    ToolEffectError
     +-- ConfigurationError              (also Celery's ImproperlyConfigured)
     |    +-- EffectRelabelRefused        a setting, header or call option tried
     |    |                               to change a tool's declared guarantees
     |    +-- ToolDeclarationError        a tool's own options break its promise
     |         +-- ToolSchemaError         a tool's signature cannot be described to an agent
     +-- StoreUnavailable                the store did not answer or refused a write
     |    +-- IntentNotRecorded           ... so a write's body did not run
     |    +-- LeaseNotSecured             ... so a write with a deadline did not start
     |    +-- IntentNotDurable            an intent was not replicated / fsynced as
     |    |                               tooleffect_store_replicas asks, so the body did not run
     |    +-- PersistenceUnreadable       neither CONFIG GET nor INFO persistence said what
     |                                    the store keeps across a restart
     +-- AuditPersistenceFailed          a write's outcome could not be recorded (UNKNOWN)
     +-- ResultNotStorable               (also kombu's EncodeError) the body returned a
     |                                   result the app's result serializer cannot encode
     +-- InterruptedWrite                a non-idempotent write started and never finished
     +-- TaskRevokedWhileRunning         revoke(terminate=True) stopped a running write
     +-- RetriesExhausted                the retry budget is spent
     +-- AttemptInProgress               an interactive call found its task running elsewhere
     +-- ToolContextError                a tool asked for what only its running call has
     +-- CallIdConflict                  a task id is another call's (another tool or
     |                                   other arguments); nothing ran
     +-- InvalidCallId                   (also ValueError) a call id or step key that
     |                                   cannot be an id
     +-- InvalidToolArguments            (also ValueError) an agent's arguments do not
     |                                   fit the tool's input schema; nothing was sent
     +-- ReconcileFailed                 a tool's reconcile timed out or answered nonsense
     +-- ApprovalRejected                a person rejected the call, or nobody decided in time
     +-- ApprovalRequired                an interactive call of a tool that needs approval
     +-- CircuitOpenError                raise it when a circuit breaker refuses a call
     +-- NoSideEffect                    raise it for an error before any side effect
     +-- DeadLettered                    (also Celery's Reject) the message is a dead letter
     +-- LeaseLost                       (also Celery's Ignore) another delivery owns the call
     +-- ChordEnded                      a replayed chord member's chord ended meanwhile
     +-- RedisServerError                (also RuntimeError) a test's redis-server did not start

Every exception class the package defines is here. A result backend stores an
exception with ``exc_module`` set to the module of its class, so a class never
leaves this module once released.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import Ignore, ImproperlyConfigured, Reject
from kombu.exceptions import EncodeError


class ToolEffectError(Exception):
    """The base of every exception celery-tooleffect raises."""


class ConfigurationError(ToolEffectError, ImproperlyConfigured):  # type: ignore[misc]
    """A setting or a tool declaration is wrong; raised when the app or the tool is
    set up, with what to do instead. Also Celery's ``ImproperlyConfigured``."""


class AuditPersistenceFailed(ToolEffectError):
    """A write's audit record could not be stored, so the write fails closed.

    It deliberately carries no failure class: the classifier maps it to
    UNKNOWN, which is never retried, because the write may already have run.
    ``body_completed`` says whether the tool body returned before the record
    was lost (the write certainly ran).
    """

    def __init__(self, message: str, *, body_completed: bool = False) -> None:
        super().__init__(message)
        self.body_completed = body_completed

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_audit_failed, (str(self), self.body_completed))


def _rebuild_audit_failed(message: str, body_completed: bool) -> AuditPersistenceFailed:
    return AuditPersistenceFailed(message, body_completed=body_completed)


class ResultNotStorable(ToolEffectError, EncodeError):
    """The tool's body returned, and the app's result serializer cannot encode
    what it returned (a ``set`` under JSON, an object pickle refuses): the
    call ran to its end (a write's effect happened) and its result cannot be
    kept. The message names the result's type and the encoder's own error;
    ``result_type`` is that type's name. Also kombu's ``EncodeError``, what
    Celery stores for a result it cannot encode, so ``except EncodeError``
    matches as on plain Celery.

    The call ends once, as a dead letter ``not_retryable`` whose letter says
    the body completed: running the body again would repeat its effect and
    return the same kind of value. Its class is UNKNOWN, not CLIENT_ERROR:
    CLIENT_ERROR tells a caller that its request was at fault and that other
    arguments may succeed, while here no caller can change the outcome (the
    tool's code returned a value the app cannot store), which is the case of
    an outcome that could not be recorded after the body returned
    (``AuditPersistenceFailed``, UNKNOWN). The class is declared on the type,
    so no registration of ``EncodeError`` makes it retried.
    """

    failure_class = "unknown"

    def __init__(self, message: str, *, result_type: str = "") -> None:
        super().__init__(message)
        self.result_type = result_type


class StoreUnavailable(ToolEffectError):
    """The journal's Redis did not answer or refused a write."""

    failure_class = "connection"


class PersistenceUnreadable(StoreUnavailable):
    """Neither ``CONFIG GET`` nor ``INFO persistence`` said what a Redis keeps
    across a restart (the worker's start-up check); the message has both errors."""


class IntentNotRecorded(StoreUnavailable):
    """The intent of a write could not be stored, so its body did not run."""


class IntentNotDurable(StoreUnavailable):
    """A write's intent was recorded on the primary but not acknowledged by the
    replicas (``WAIT``) or fsynced (``WAITAOF``) as the settings ask: the body
    did not run. ``attempt`` is the attempt the journal recorded (to be
    settled by its owner)."""

    def __init__(self, message: str, attempt: int = 0) -> None:
        super().__init__(message)
        self.attempt = attempt


class LeaseNotSecured(StoreUnavailable):
    """The broker lease could not be extended for the deadline; the write did not start."""


class EffectRelabelRefused(ConfigurationError):
    """Configuration, a header or a call option tried to change a guarantee.

    A tool's effect, and the options its guarantees depend on, are properties
    of its code.
    """


class ToolDeclarationError(ConfigurationError):
    """A tool declares options that would break its effect's promise.

    Raised when the task is bound (at import of the module that defines it),
    with what to do instead.
    """


class ToolSchemaError(ToolDeclarationError):
    """A tool's signature cannot be described to an agent (a parameter
    without a type, ``*args``, a type pydantic cannot describe): raised when
    the tool is offered to one (the MCP server refuses to start), naming the
    tool and why."""


class DeadLettered(ToolEffectError, Reject):  # type: ignore[misc]
    """The message was stored as a dead letter and is rejected without requeue.

    ``reason`` (Celery's ``Reject.reason``) is the error that decided it; the
    classifier unwraps it. ``args`` are plain strings so that the result
    backend (JSON included) and the ``task-failed`` event Flower shows both
    carry the failure class and the dead-letter reason.
    """

    def __init__(
        self,
        description: str,
        failure_class: str,
        dead_letter_reason: str,
        reason: BaseException | None = None,
        *,
        pending_letter: Any = None,
        error: BaseException | None = None,
    ) -> None:
        # Reject's __init__ (ToolEffectError, before it in the MRO, has none).
        Reject.__init__(self, reason, requeue=False)
        self.args = (description, failure_class, dead_letter_reason)
        self.description = description
        self.failure_class = failure_class
        self.dead_letter_reason = dead_letter_reason
        #: The letter a tool decided (a ``celery_tooleffect.worker.handoff.PendingLetter``),
        #: on its way from the pool process to the worker's main process, which
        #: holds the message and stores it; taken off there, so that it never
        #: reaches a result backend. None once stored, or when this process
        #: stored it.
        self.pending_letter = pending_letter
        #: The exception Celery's result shows instead of this one: what the
        #: tool's body raised (or the arguments' ``TypeError``). The pool
        #: process raises it in place of this ``DeadLettered``, so that
        #: Celery's tracer stores and reports it as plain Celery would
        #: (``docs/guide.md``, "What a failed call's result holds"). None when
        #: the failure is the package's own (an audit that could not be
        #: stored, an interrupted write, a conflict, a forged header): then
        #: the result is this ``DeadLettered``.
        self.error = error

    def __str__(self) -> str:
        return (
            f"dead-lettered ({self.dead_letter_reason}, failure_class={self.failure_class}): "
            f"{self.description}"
        )

    def __repr__(self) -> str:
        return f"DeadLettered({str(self)!r})"


class LeaseLost(ToolEffectError, Ignore):  # type: ignore[misc]
    """This worker no longer owns the attempt; another delivery settles it.

    The outcome was recorded as a ``late_outcome`` audit event. The worker's
    request class then forgets the message without acknowledging it on Redis:
    there the delivery tag is shared with the new holder, and an
    acknowledgement would delete the new holder's copy.
    """


class InterruptedWrite(ToolEffectError):
    """A non-idempotent write started and never finished; it is never run again."""


class TaskRevokedWhileRunning(ToolEffectError):
    """``revoke(terminate=True)`` stopped a write while its body ran; it is a dead letter."""


class RetriesExhausted(ToolEffectError):
    """A tool kept failing or being interrupted until its retry budget was spent."""


class AttemptInProgress(ToolEffectError):
    """An interactive call (``apply()``, a direct call) found the same task id
    running elsewhere; try again when that attempt has ended."""

    failure_class = "connection"


class ToolContextError(ToolEffectError):
    """A tool asked for what only a running call has: ``self.idempotency_key``
    outside the tool's body, or ``self.fencing_token`` of a READ_ONLY tool
    (which keeps no journal) or outside a write's body."""


class CallIdConflict(ToolEffectError):
    """A call's task id already belongs to another call: another tool, or the
    same tool with other arguments (``docs/identity.md``). Nothing of this call
    ran, and the other call's result is left as it is. Raised at publish time
    when the caller chose the task id (``task_id=``, ``call_id=``, a tool
    called in a tool's body); a worker that meets one dead-letters it
    (reason ``call_id_conflict``). Class CLIENT_ERROR: never retried."""

    failure_class = "client_error"

    def __init__(self, message: str, *, task_id: str = "", tool: str = "",
                 recorded_tool: str = "", conflict: str = "") -> None:
        super().__init__(message)
        self.task_id = task_id
        self.tool = tool
        #: The tool the task id belongs to.
        self.recorded_tool = recorded_tool
        #: What differs: 'tool' or 'arguments'.
        self.conflict = conflict

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_conflict, (str(self), self.task_id, self.tool,
                                    self.recorded_tool, self.conflict))


def _rebuild_conflict(message: str, task_id: str, tool: str, recorded_tool: str,
                      conflict: str) -> CallIdConflict:
    return CallIdConflict(message, task_id=task_id, tool=tool, recorded_tool=recorded_tool,
                          conflict=conflict)


class InvalidCallId(ToolEffectError, ValueError):
    """A call id, run id or step key that cannot be an id: not text, empty, or
    longer than 200 characters. Raised before anything is published or run."""

    failure_class = "client_error"


class InvalidToolArguments(ToolEffectError, ValueError):
    """An agent's arguments do not fit the tool's input schema; nothing was
    published. ``errors`` are pydantic's, each naming its field (``loc``)."""

    def __init__(self, message: str, *, tool: str = "",
                 errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.tool = tool
        self.errors = errors or []

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_invalid_arguments, (str(self), self.tool, self.errors))


def _rebuild_invalid_arguments(message: str, tool: str,
                               errors: list[dict[str, Any]]) -> InvalidToolArguments:
    return InvalidToolArguments(message, tool=tool, errors=errors)


class ReconcileFailed(ToolEffectError):
    """A tool's ``reconcile`` did not answer in time
    (``tooleffect_reconcile_timeout``) or answered something that is not a
    ``Reconciliation``; the interrupted write stays a dead letter."""


class ApprovalRejected(ToolEffectError):
    """A call that needed a person's approval was rejected, or nobody decided it
    within ``tooleffect_approval_timeout`` (then the reason says it expired).
    Nothing of the call ran. Class CLIENT_ERROR: never retried."""

    failure_class = "client_error"


class ApprovalRequired(ToolEffectError):
    """A tool that needs approval was called interactively (``apply()``, eager
    mode, a direct call) without an approval: only a queued call can be parked
    for a person to decide, so queue it (``apply_async``)."""

    failure_class = "client_error"


class CircuitOpenError(ToolEffectError):
    """Raise when a circuit breaker refuses a call; classified CIRCUIT_OPEN
    (retried with backoff)."""

    failure_class = "circuit_open"


class NoSideEffect(ToolEffectError):
    """An error raised before the tool touched anything outside itself.

    Wrap (``raise NoSideEffect(exc) from exc``) or subclass it. A
    NON_IDEMPOTENT_WRITE that fails with it may be retried like any other tool,
    because the write provably did not happen. Its class is the wrapped
    error's class.
    """

    def __init__(self, error: BaseException | str = "failed before any side effect") -> None:
        super().__init__(error)
        self.error = error


class ChordEnded(ToolEffectError):
    """The chord of a replayed dead letter (a chord member) ended meanwhile; the
    replay is refused and the letter kept."""


class RedisServerError(ToolEffectError, RuntimeError):
    """No ``redis-server`` binary, or one that did not start
    (:mod:`celery_tooleffect.testing`, the demo)."""
