"""celery-tooleffect: Celery tasks that are safe to use as the tools of AI agents.

Every tool declares its side effect; writes keep a journal in Redis, fail
closed when their audit cannot be stored, and are never run twice when
interrupted. See the README for the guarantees and how they are tested.
"""

from typing import TYPE_CHECKING, Any

from .effect import ToolEffect, ToolEffectInterface, ToolEffectResolver
from .errors import (
    ApprovalRejected,
    ApprovalRequired,
    AttemptInProgress,
    AuditPersistenceFailed,
    CallIdConflict,
    ChordEnded,
    CircuitOpenError,
    ConfigurationError,
    DeadLettered,
    EffectRelabelRefused,
    IntentNotDurable,
    IntentNotRecorded,
    InterruptedWrite,
    InvalidCallId,
    InvalidToolArguments,
    LeaseLost,
    LeaseNotSecured,
    NoSideEffect,
    PersistenceUnreadable,
    ReconcileFailed,
    RedisServerError,
    ResultNotStorable,
    RetriesExhausted,
    StoreUnavailable,
    TaskRevokedWhileRunning,
    ToolContextError,
    ToolDeclarationError,
    ToolEffectError,
    ToolSchemaError,
)
from .events import AuditEvent
from .failures import FailureClass, FailureClassifier
from .identity import call_task_id
from .reconciliation import ReconcileStatus, Reconciliation
from .signals import approval_requested
from .states import ApprovalState, Approver, CallStatus, DeadLetterReason, JournalState
from .store.approvals import Approval
from .store.audit import AuditLog
from .store.dead_letter_record import DeadLetter
from .store.dead_letters import DeadLetters
from .store.journal import Journal
from .task import ToolTask

__all__ = [
    "Approval",
    "ApprovalRejected",
    "ApprovalRequired",
    "ApprovalState",
    "Approvals",
    "Approver",
    "AttemptInProgress",
    "AuditEvent",
    "AuditLog",
    "AuditPersistenceFailed",
    "CallIdConflict",
    "CallStatus",
    "ChordEnded",
    "CircuitOpenError",
    "ConfigurationError",
    "DeadLetter",
    "DeadLetterReason",
    "DeadLettered",
    "DeadLetters",
    "EffectRelabelRefused",
    "FailureClass",
    "FailureClassifier",
    "IntentNotDurable",
    "IntentNotRecorded",
    "InterruptedWrite",
    "InvalidCallId",
    "InvalidToolArguments",
    "Journal",
    "JournalState",
    "LeaseLost",
    "LeaseNotSecured",
    "NoSideEffect",
    "PersistenceUnreadable",
    "ReconcileFailed",
    "ReconcileStatus",
    "Reconciliation",
    "RedisServerError",
    "ResultNotStorable",
    "RetriesExhausted",
    "StoreUnavailable",
    "TaskRevokedWhileRunning",
    "ToolContextError",
    "ToolDeclarationError",
    "ToolEffect",
    "ToolEffectError",
    "ToolEffectInterface",
    "ToolEffectResolver",
    "ToolSchemaError",
    "ToolTask",
    "approval_requested",
    "call_task_id",
]

if TYPE_CHECKING:
    from .admin.approvals import Approvals


def __getattr__(name: str) -> Any:
    # PEP 562: ``Approvals`` is the operators' API (admin/); it is loaded when
    # first asked for, so that importing the package (every worker, every
    # producer) loads nothing of admin/.
    if name == "Approvals":
        from .admin.approvals import Approvals

        globals()[name] = Approvals
        return Approvals
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The version's one place: the distribution's version is read from this line
# (pyproject.toml, [tool.setuptools.dynamic]), so keep it a plain string.
__version__ = "0.1.0"
