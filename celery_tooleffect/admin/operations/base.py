"""What every action on the dead letters of one app shares: the app and its
stores, reading (:meth:`OperationsBase.listing`, :meth:`OperationsBase.detail`,
stats, counts), and the audit event and result of an action on a letter."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...actions.reconciling import reconciler_of
from ...effect import ToolEffect
from ...errors import StoreUnavailable
from ...events import AuditEvent
from ...store.audit import worker_identity
from ...store.chords import chord_member, chord_refusal
from ...store.dead_letter_queries import Cursor, DeadLetterQuery, DeadLetterStats, backlog_warnings
from ...store.dead_letter_record import DeadLetter
from ...store.journal import JournalRef
from ...store.runtime import ToolRuntime, runtime_for
from .results import REASON_LIMIT, ActionResult, Outcome
from .rules import letter_effect, letter_label, letter_run_id, reconcile_refusal
from .views import letter_detail, letter_listing

if TYPE_CHECKING:
    from celery import Celery


class OperationsBase:
    """The app, its stores and how its letters are read; the actions build on it."""

    def __init__(self, app: Celery, runtime: ToolRuntime | None = None) -> None:
        self.app = app
        self.runtime = runtime or runtime_for(app)

    @property
    def privacy(self) -> str:
        return self.runtime.settings.privacy

    @property
    def accept(self) -> Any:
        """The content types this app's workers accept: what may be decoded for display."""
        return self.app.conf.accept_content

    # -- reading -----------------------------------------------------------------

    def stats(self) -> DeadLetterStats:
        return self.runtime.dead_letters.stats()

    def backlog_warnings(self) -> list[str]:
        """The queues whose unresolved dead letters pass a threshold
        (``tooleffect_dead_letter_warn_count``, ``_warn_age``), one line each.
        Raises :class:`StoreUnavailable`."""
        return backlog_warnings(self.runtime.dead_letters.backlog(), self.runtime.settings,
                                time.time())

    def detail(self, task_id: str, *, page: bool = False) -> dict[str, Any] | None:
        """:func:`letter_detail` of ``task_id``'s letter (or of one being replayed), or
        None; ``page``: refusals in the words of Flower's page."""
        letters = self.runtime.dead_letters
        letter = letters.get(task_id)
        taken = False
        if letter is None:
            unfinished = letters.taken(task_id)
            if unfinished is None:
                return None
            letter, taken = unfinished[0], True
        detail = letter_detail(letter, self._journal(letter), taken=taken, accept=self.accept,
                               chord_refusal=self._chord_refusal(letter), page=page)
        declared = reconciler_of(self.app.tasks.get(letter.name)) is not None
        detail["reconcile"] = {"refusal": reconcile_refusal(letter, declared=declared)}
        return detail

    def listing(self, query: DeadLetterQuery, *, limit: int,
                before: Cursor | None = None) -> dict[str, Any]:
        """One page of the letters matching ``query``, newest first, starting after
        ``before``: :func:`~celery_tooleffect.admin.operations.views.letter_listing`."""
        page = self.runtime.dead_letters.page(query, limit=limit, before=before)
        return letter_listing(page, self.privacy, self.accept)

    def trail(self, task_id: str, run_id: str) -> list[Any]:
        """The audit events of ``task_id`` in its run ``run_id``, oldest first."""
        return [event for event in self.runtime.audit.events(run_id)
                if event.get("task_id") == task_id]

    def bulk_preview(self, query: DeadLetterQuery, *, older_than: float | None = None
                     ) -> dict[str, int]:
        """What a bulk action on ``query`` would touch: ``matching`` letters, of which
        ``non_idempotent`` are NON_IDEMPOTENT_WRITEs (never replayed in bulk)."""
        matching = self.count_matching(query, older_than=older_than)
        risky = ToolEffect.NON_IDEMPOTENT_WRITE.value
        non_idempotent = (self.count_matching(replace(query, effect=risky), older_than=older_than)
                          if query.effect in (None, risky) else 0)
        return {"matching": matching, "non_idempotent": non_idempotent}

    def count_matching(self, query: DeadLetterQuery, *, older_than: float | None = None) -> int:
        """How many letters a bulk action on ``query`` would touch (walks only the matches)."""
        cutoff = None if older_than is None else time.time() - max(older_than, 0.0)
        return sum(len(batch) for batch in
                   self.runtime.dead_letters.matching_ids(query, older_than=cutoff))

    def _chord_refusal(self, letter: DeadLetter) -> str | None:
        """Why a replay of ``letter`` could not complete its chord (None: not in one, or it can)."""
        member = chord_member(letter, self.accept)
        if member is None:
            return None
        try:
            return chord_refusal(self.app, letter, member, reopen=False)
        except Exception as exc:  # the result backend did not answer
            return (f"{letter_label(letter)}: its chord {member.group_id} could not be "
                    f"checked: {exc}")

    def _journal(self, letter: DeadLetter) -> dict[str, str] | None:
        if not letter_effect(letter).is_write:
            return None
        try:
            ref = JournalRef(letter_run_id(letter), letter.task_id)
            return self.runtime.journal.read(ref) or None
        except StoreUnavailable:
            return None

    # -- the audit event and result of an action ---------------------------------

    def _event(
        self, letter: DeadLetter, phase: str, status: str, *, actor: str, reason: str,
        force: bool, via: str,
    ) -> AuditEvent:
        """The audit event of an operator's action on ``letter``."""
        return AuditEvent.of(
            run_id=letter_run_id(letter),
            task_id=letter.task_id,
            tool=letter.name,
            effect=letter.effect,
            phase=phase,
            status=status,
            worker=worker_identity(),
            queue=letter.queue,
            failure_class=letter.failure_class,
            actor=actor,
            reason=reason.strip()[:REASON_LIMIT],
            forced=force,
            via=via,
            dead_letter_reason=letter.reason,
        )

    @staticmethod
    def _result(letter: DeadLetter, action: str, outcome: Outcome, message: str) -> ActionResult:
        return ActionResult(letter.task_id, action, outcome, message, letter.name,
                            letter.effect, letter.queue)
