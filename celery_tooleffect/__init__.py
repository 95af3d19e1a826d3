"""celery-tooleffect: Celery tasks that are safe to use as the tools of AI agents.

Every tool declares its side effect; writes keep a journal in Redis, fail
closed when their audit cannot be stored, and are never run twice when
interrupted. See the README for the guarantees and how they are tested.
"""

from .audit import AuditLog
from .dead_letters import DeadLetter, DeadLetterReason, DeadLetters
from .effect import ToolEffect, ToolEffectInterface, ToolEffectResolver
from .errors import (
    AuditPersistenceFailed,
    DeadLettered,
    EffectRelabelRefused,
    IntentNotRecorded,
    InterruptedWrite,
    LeaseLost,
    LeaseNotSecured,
    RetriesExhausted,
    StoreUnavailable,
    ToolDeclarationError,
)
from .failures import CircuitOpenError, FailureClass, FailureClassifier, NoSideEffect
from .journal import Journal, JournalState
from .task import AttemptInProgress, ToolTask

__all__ = [
    "AttemptInProgress",
    "AuditLog",
    "AuditPersistenceFailed",
    "CircuitOpenError",
    "DeadLetter",
    "DeadLetterReason",
    "DeadLettered",
    "DeadLetters",
    "EffectRelabelRefused",
    "FailureClass",
    "FailureClassifier",
    "IntentNotRecorded",
    "InterruptedWrite",
    "Journal",
    "JournalState",
    "LeaseLost",
    "LeaseNotSecured",
    "NoSideEffect",
    "RetriesExhausted",
    "StoreUnavailable",
    "ToolDeclarationError",
    "ToolEffect",
    "ToolEffectInterface",
    "ToolEffectResolver",
    "ToolTask",
]

__version__ = "0.1.0"
