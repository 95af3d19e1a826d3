"""Reconciling dead letters: asking a letter's tool whether its write happened
(its ``reconcile``), and ending the letter so, audited with the evidence."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace

from celery.app.task import Context

from ...actions.reconciling import ask_reconciler, reconciler_of
from ...errors import StoreUnavailable
from ...events import AuditEvent
from ...reconciliation import ReconcileStatus, Reconciliation
from ...states import DeadLetterReason, JournalState
from ...store import states
from ...store.audit import describe_payload
from ...store.dead_letter_queries import DeadLetterQuery
from ...store.dead_letter_record import DeadLetter
from ...store.journal import JournalRef
from .replay import Replaying
from .results import ActionResult, Outcome
from .rules import letter_effect, letter_label, letter_run_id, reconcile_refusal
from .stores import STORE_ERRORS

logger = logging.getLogger(__name__)


class Reconciling(Replaying):
    """Reconcile one dead letter, or every letter a query matches; a letter whose
    write did not happen is replayed."""

    def reconcile(self, task_id: str, *, actor: str, via: str = "cli") -> ActionResult:
        """Ask the tool of one dead letter whether its write happened, and end it so.

        For a letter whose write may have happened (``interrupted_write``,
        ``revoked``, or an outcome that could not be recorded) of a tool that
        declares ``reconcile`` (registered in this app). Applied: the journal
        and the result backend say SUCCESS with the tool's result, and the
        letter is removed (the message's callbacks are not run: the workflow
        broke when the letter was made). Not applied: the letter is replayed,
        except a ``revoked`` one, which someone chose to stop. Unknown, or a
        ``reconcile`` that fails or times out: the letter stays. Audited
        (phase ``reconcile``) with the evidence.
        """
        runtime = self.runtime
        try:
            letter = runtime.dead_letters.get(task_id)
        except STORE_ERRORS as exc:
            return ActionResult(task_id, "reconcile", Outcome.FAILED,
                                f"{task_id}: not reconciled: {exc}")
        if letter is None:
            return ActionResult(task_id, "reconcile", Outcome.NOT_FOUND,
                                f"{task_id}: no such dead letter")
        tool = self.app.tasks.get(letter.name)
        check = reconciler_of(tool)
        refusal = reconcile_refusal(letter, declared=check is not None)
        if refusal or check is None:
            return self._result(letter, "reconcile", Outcome.REFUSED,
                                refusal or f"{letter_label(letter)}: no reconcile")
        try:
            args, kwargs, _ = letter.payload(self.accept)
        except Exception as exc:
            return self._result(letter, "reconcile", Outcome.FAILED,
                                f"{letter_label(letter)}: its arguments could not be read "
                                f"({type(exc).__name__}: {exc})")
        run_id = letter_run_id(letter)
        # The run id as the task's root: self.idempotency_key derives the same key.
        request = Context(id=letter.task_id, root_id=run_id, called_directly=False)
        answer, problem = ask_reconciler(check, tool, request, tuple(args), kwargs,
                                         timeout=runtime.settings.reconcile_timeout)
        status = ReconcileStatus.FAILED if answer is None else answer.status
        evidence = answer.evidence if answer is not None else (
            f"{type(problem).__name__}: {problem}")
        event = self._event(letter, "reconcile", status.value, actor=actor, reason="",
                            force=False, via=via)
        event = replace(event.amended(**describe_payload(self.privacy, evidence=evidence)),
                        exception_type=None if problem is None else type(problem).__qualname__)
        seen = (f"{letter_label(letter)}: reconcile answered {status.value} "
                f"({evidence or 'no evidence'})")
        if answer is None or status is ReconcileStatus.UNKNOWN:
            runtime.audit.record_step(event)
            outcome = Outcome.FAILED if answer is None else Outcome.REFUSED
            return self._result(letter, "reconcile", outcome, f"{seen}; the dead letter stays")
        if status is ReconcileStatus.NOT_APPLIED:
            runtime.audit.record_step(event)
            if letter.reason == DeadLetterReason.REVOKED.value:
                return self._result(letter, "reconcile", Outcome.REFUSED,
                                    f"{seen}; it was revoked, so it stays a dead letter")
            replayed = self.replay(task_id, actor=actor, force=True, via=via,
                                   reason=f"reconciled: not applied ({evidence})")
            return replace(replayed, action="reconcile", message=f"{seen}; {replayed.message}")
        return self._settle_applied(letter, answer, event, seen)

    def _settle_applied(
        self, letter: DeadLetter, answer: Reconciliation, event: AuditEvent, seen: str,
    ) -> ActionResult:
        """The letter's write happened: SUCCEEDED in the journal and the result
        backend, and the letter removed."""
        runtime = self.runtime
        letters = runtime.dead_letters
        taken = letters.take(letter.task_id)
        if taken is None:
            return self._result(letter, "reconcile", Outcome.NOT_FOUND,
                                f"{seen}; the letter was replayed or purged meanwhile")
        try:
            if letter_effect(letter).is_write:
                moved = runtime.journal.transition(
                    JournalRef(letter_run_id(letter), letter.task_id),
                    new_state=JournalState.SUCCEEDED, allowed=states.RECONCILED_LETTER_FROM,
                    token="", event=event.amended(reconciled="1"), record_late=False,
                )
                if not moved:
                    letters.put_back(taken)
                    return self._result(letter, "reconcile", Outcome.REFUSED,
                                        f"{seen}; but its journal is {moved.previous_state!r} "
                                        "now: the letter stays")
            elif not runtime.audit.record_step(event):
                letters.put_back(taken)
                return self._result(letter, "reconcile", Outcome.FAILED,
                                    f"{seen}; its audit event could not be stored")
        except StoreUnavailable as exc:
            letters.put_back(taken)
            return self._result(letter, "reconcile", Outcome.FAILED, f"{seen}; {exc}")
        try:
            self.app.backend.mark_as_done(letter.task_id, answer.result)
        except Exception as exc:  # recorded in the journal already: the letter goes
            logger.warning("%s: result not stored on the backend: %s", letter_label(letter), exc)
        with contextlib.suppress(StoreUnavailable):
            letters.forget_taken(letter.task_id)
        return self._result(letter, "reconcile", Outcome.DONE,
                            f"{seen}; settled SUCCESS, the dead letter is removed")

    def reconcile_matching(
        self, query: DeadLetterQuery, *, actor: str, via: str = "cli",
    ) -> Iterator[ActionResult]:
        """Reconcile every letter matching ``query`` (one result each; letters that
        cannot be reconciled are refused)."""
        for batch in self.runtime.dead_letters.matching_ids(query):
            for task_id in batch:
                yield self.reconcile(task_id, actor=actor, via=via)
