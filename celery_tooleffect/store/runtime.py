"""The parts of one app's tools that live in Redis, built once per app.

:class:`ToolRuntime` bundles the settings, audit log, journal, dead letters,
approvals, broker leases and failure classifier of one Celery app; the worker and the
operator commands both reach the store through it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ..failures import FailureClassifier
from ..settings import Settings, settings_for
from .approvals import ApprovalStore
from .audit import AuditLog
from .calls import CallClaims
from .dead_letters import DeadLetters
from .journal import Journal
from .leases import Leases

if TYPE_CHECKING:
    from celery import Celery


class ToolRuntime:
    """Settings, audit log, journal, dead letters, approvals, call claims and
    classifier of one app."""

    def __init__(self, app: Celery) -> None:
        self.settings: Settings = settings_for(app)
        self.audit = AuditLog(app, self.settings)
        self.journal = Journal(self.settings, self.audit)
        self.dead_letters = DeadLetters(app, self.settings)
        self.approvals = ApprovalStore(self.settings, self.audit)
        self.leases = Leases(self.settings)
        self.calls = CallClaims(self.settings)
        self.classifier = FailureClassifier.from_setting(self.settings.failure_classes)


_runtimes: weakref.WeakKeyDictionary[Any, ToolRuntime] = weakref.WeakKeyDictionary()


def runtime_for(app: Celery) -> ToolRuntime:
    """The runtime of ``app``, built once per app."""
    runtime = _runtimes.get(app)
    if runtime is None:
        runtime = ToolRuntime(app)
        _runtimes[app] = runtime
    return runtime
