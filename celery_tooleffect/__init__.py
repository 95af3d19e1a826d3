"""celery-tooleffect: Celery tasks that are safe to use as the tools of AI agents.

Every tool declares its side effect; writes keep a journal in Redis, fail
closed when their audit cannot be stored, and are never run twice when
interrupted. See the README for the guarantees and how they are tested.
"""

from .admin.approvals import Approvals
from .effect import ToolEffect, ToolEffectInterface, ToolEffectResolver
from .errors import (
    ApprovalRejected,
    ApprovalRequired,
    AttemptInProgress,
    AuditPersistenceFailed,
    CallIdConflict,
    ConfigurationError,
    DeadLettered,
    EffectRelabelRefused,
    IntentNotDurable,
    IntentNotRecorded,
    InterruptedWrite,
    InvalidCallId,
    LeaseLost,
    LeaseNotSecured,
    ReconcileFailed,
    RetriesExhausted,
    StoreUnavailable,
    TaskRevokedWhileRunning,
    ToolContextError,
    ToolDeclarationError,
    ToolEffectError,
)
from .events import AuditEvent
from .failures import CircuitOpenError, FailureClass, FailureClassifier, NoSideEffect
from .identity import call_task_id
from .reconciliation import ReconcileStatus, Reconciliation
from .signals import approval_requested
from .store.approvals import Approval
from .store.audit import AuditLog
from .store.dead_letters import DeadLetter, DeadLetterReason, DeadLetters
from .store.journal import Journal
from .store.states import ApprovalState, JournalState
from .task import ToolTask

__all__ = [
    "Approval",
    "ApprovalRejected",
    "ApprovalRequired",
    "ApprovalState",
    "Approvals",
    "AttemptInProgress",
    "AuditEvent",
    "AuditLog",
    "AuditPersistenceFailed",
    "CallIdConflict",
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
    "Journal",
    "JournalState",
    "LeaseLost",
    "LeaseNotSecured",
    "NoSideEffect",
    "ReconcileFailed",
    "ReconcileStatus",
    "Reconciliation",
    "RetriesExhausted",
    "StoreUnavailable",
    "TaskRevokedWhileRunning",
    "ToolContextError",
    "ToolDeclarationError",
    "ToolEffect",
    "ToolEffectError",
    "ToolEffectInterface",
    "ToolEffectResolver",
    "ToolTask",
    "approval_requested",
    "call_task_id",
]

# The version's one place: the distribution's version is read from this line
# (pyproject.toml, [tool.setuptools.dynamic]), so keep it a plain string.
__version__ = "0.1.0"
