"""Purging dead letters: each removal audited (a ``purged`` event with who and
why), the letter kept when its event cannot be stored."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from ...errors import StoreUnavailable
from ...store.dead_letter_queries import DeadLetterQuery
from ...store.dead_letter_record import DeadLetter
from ...store.journal import JournalRef
from .base import OperationsBase
from .results import ActionResult, Outcome
from .rules import letter_label, letter_run_id

logger = logging.getLogger(__name__)


class Purging(OperationsBase):
    """Purge one dead letter, or every letter a query matches stored long enough ago."""

    def purge(
        self, task_id: str, *, actor: str, reason: str = "", via: str = "cli",
    ) -> ActionResult:
        """Remove one dead letter, audited; the letter stays when its event cannot be stored."""
        letters = self.runtime.dead_letters
        try:
            letter = letters.take(task_id)
            if letter is None:
                return ActionResult(task_id, "purge", Outcome.NOT_FOUND,
                                    f"{task_id}: no such dead letter")
            event = self._event(letter, "purged", "removed", actor=actor, reason=reason,
                                force=False, via=via)
            if not self.runtime.audit.record_step(event):
                letters.put_back(letter)
                return self._result(letter, "purge", Outcome.FAILED,
                                    f"{letter_label(letter)} not purged: its audit event could not "
                                    "be stored")
            letters.forget_taken(task_id)
        except StoreUnavailable as exc:
            return ActionResult(task_id, "purge", Outcome.FAILED, f"{task_id}: not purged: {exc}")
        self._release([letter])
        return self._result(letter, "purge", Outcome.DONE, f"purged {letter_label(letter)}")

    def purge_matching(
        self, query: DeadLetterQuery, *, older_than: float, actor: str, reason: str = "",
        via: str = "cli",
    ) -> Iterator[ActionResult]:
        """Purge every letter matching ``query`` stored more than ``older_than`` seconds ago."""
        cutoff = time.time() - max(older_than, 0.0)
        for batch in self.runtime.dead_letters.matching_ids(query, older_than=cutoff):
            yield from self._purge_batch(batch, actor=actor, reason=reason, via=via)

    def _purge_batch(
        self, task_ids: list[str], *, actor: str, reason: str, via: str,
    ) -> Iterator[ActionResult]:
        """:meth:`purge` of each of ``task_ids``, each step in one round trip for the
        whole batch (read, take, audit, forget); each letter's removal stays
        atomic and audited. A letter that is not simply there goes the
        one-by-one way."""
        letters = self.runtime.dead_letters
        try:
            held = letters.get_many(task_ids)
            present = [entry for entry in held if entry is not None]
            taken = letters.take_many(present)
        except StoreUnavailable:
            held, present, taken = [], [], []
        mine = [entry.letter for entry, ok in zip(present, taken, strict=True) if ok]
        mine_ids = {letter.task_id for letter in mine}
        events = [self._event(letter, "purged", "removed", actor=actor, reason=reason,
                              force=False, via=via) for letter in mine]
        purged = []
        for letter, stored in zip(mine, self.runtime.audit.record_steps(events), strict=True):
            if stored:
                purged.append(letter.task_id)
                yield self._result(letter, "purge", Outcome.DONE, f"purged {letter_label(letter)}")
                continue
            with contextlib.suppress(StoreUnavailable):  # else kept aside, as in progress
                letters.put_back(letter)
            yield self._result(letter, "purge", Outcome.FAILED,
                               f"{letter_label(letter)} not purged: its audit event could not be "
                               "stored")
        with contextlib.suppress(StoreUnavailable):
            letters.forget_taken_many(purged)
        self._release([letter for letter in mine if letter.task_id in purged])
        for task_id in task_ids:
            if task_id not in mine_ids:
                yield self.purge(task_id, actor=actor, reason=reason, via=via)

    def _release(self, letters: list[DeadLetter]) -> None:
        """Let the journal entries of purged letters expire with the retention
        (kept without a TTL while the letter existed: DESIGN §7). Best effort:
        the purge is done and audited; an entry left without a TTL is logged
        with its key."""
        refs = [JournalRef(letter_run_id(letter), letter.task_id) for letter in letters]
        try:
            self.runtime.journal.release(refs)
        except StoreUnavailable as exc:
            logger.warning("purged, but %d journal entries keep no TTL (%s): %s", len(refs),
                           exc, ", ".join(f"{ref.run_id}/{ref.task_id}" for ref in refs))
