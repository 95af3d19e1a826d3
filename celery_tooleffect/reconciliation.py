"""Reconciliation: what a write tool answers when asked whether an interrupted
attempt's write happened.

A NON_IDEMPOTENT_WRITE whose attempt was interrupted (its worker killed, its
lease lapsed) may or may not have made its side effect. A tool that can find
out (typically by asking the provider about its ``self.idempotency_key``)
declares ``reconcile``, with the same arguments as its body::

    @app.task(base=ToolTask, bind=True, effect=ToolEffect.NON_IDEMPOTENT_WRITE,
              reconcile=find_charge)
    def charge_card(self, customer_id, amount_cents): ...

    def find_charge(self, customer_id, amount_cents):
        charge = payments.find(idempotency_key=self.idempotency_key)
        if charge is None:
            return Reconciliation.not_applied(evidence="no charge with that key")
        return Reconciliation.applied(charge.id, evidence=f"charge {charge.id}")

and answers with one of the three constructors below. The worker then ends
the task as :class:`Reconciliation` says (see its members).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .choices import Choice


class ReconcileStatus(Choice):
    """What a reconciliation found, as the audit records it (phase ``reconcile``)."""

    __choice_name__ = "a reconciliation status"

    #: The write happened: the task succeeds with the given result, its body
    #: does not run again.
    APPLIED = "applied"
    #: The write did not happen: the body runs again, as a new attempt.
    NOT_APPLIED = "not_applied"
    #: Nobody can tell: the task is a dead letter, as without ``reconcile``.
    UNKNOWN = "unknown"
    #: ``reconcile`` raised, timed out or answered something else (audit only).
    FAILED = "failed"


@dataclass(frozen=True)
class Reconciliation:
    """The answer of a tool's ``reconcile``: build it with :meth:`applied`,
    :meth:`not_applied` or :meth:`unknown`."""

    status: ReconcileStatus
    #: For APPLIED: the task's result, as the body would have returned it.
    result: Any = None
    #: What the answer rests on, for the audit and the operator (a provider's
    #: record id, "no charge with that key", ...).
    evidence: str = ""

    @classmethod
    def applied(cls, result: Any = None, *, evidence: str = "") -> Reconciliation:
        """The write happened; ``result`` is what the body would have returned."""
        return cls(ReconcileStatus.APPLIED, result, str(evidence))

    @classmethod
    def not_applied(cls, *, evidence: str = "") -> Reconciliation:
        """The write did not happen: running the body again is safe."""
        return cls(ReconcileStatus.NOT_APPLIED, None, str(evidence))

    @classmethod
    def unknown(cls, *, evidence: str = "") -> Reconciliation:
        """Whether the write happened cannot be told: a person decides."""
        return cls(ReconcileStatus.UNKNOWN, None, str(evidence))
