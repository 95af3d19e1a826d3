"""Replaying dead letters, one audited step each (see the package docs): take
the letter, record the replay (a write's journal reset with its event, a
read's event alone), publish the message again; undo the step when it could
not be published."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ...actions.republish import republish
from ...effect import ToolEffect
from ...errors import ChordEnded, StoreUnavailable
from ...events import AuditEvent
from ...states import JournalState
from ...store import states
from ...store.chords import chord_member, chord_refusal
from ...store.dead_letter_queries import DeadLetterQuery
from ...store.dead_letter_record import DeadLetter
from ...store.journal import JournalRef, ReplayRequest
from .base import OperationsBase
from .results import ActionResult, Outcome
from .rules import journal_refusal, letter_effect, letter_label, letter_run_id, replay_refusal
from .stores import STORE_ERRORS

if TYPE_CHECKING:
    from celery import Celery

#: Seconds after which a letter taken by a replay or purge that never finished
#: is taken to be abandoned (its process died), so a new replay may resume it.
ABANDONED_AFTER = 120.0


@dataclass(frozen=True)
class _ReplayStep:
    """One taken letter's replay: its ``replayed`` event and, for a write, the
    journal reset that stores that event."""

    letter: DeadLetter
    event: AuditEvent
    request: ReplayRequest | None


def publish(app: Celery, letter: DeadLetter, *, mark: str) -> None:
    """Publish ``letter``'s message again, as :meth:`MessageEnvelope.replayed` says:
    the same bytes, headers and properties, to the same exchange and routing key,
    with ``retries`` 0, no ``eta`` or ``expires``, and the replay ``mark``.

    The app's queue of that name is declared first when the app knows it.
    Raises ``ValueError`` for a letter that keeps no message (envelope version
    1), which :func:`~.rules.replay_refusal` refuses before.
    """
    if letter.message is None:
        raise ValueError(f"{letter_label(letter)} keeps no message to publish "
                         f"(envelope version {letter.version})")
    republish(app, letter.message.replayed(mark), letter.queue)


class Replaying(OperationsBase):
    """Replay one dead letter, or every letter a query matches (bulk rules)."""

    def replay(
        self, task_id: str, *, actor: str, reason: str = "", force: bool = False,
        bulk: bool = False, via: str = "cli",
    ) -> ActionResult:
        """Replay one dead letter under the rules of the package docs."""
        letters = self.runtime.dead_letters
        try:
            letter = letters.get(task_id)
            if letter is None:
                unfinished = letters.taken(task_id)
                if unfinished is None:
                    return ActionResult(task_id, "replay", Outcome.NOT_FOUND,
                                        f"{task_id}: no such dead letter")
                letter, taken_at = unfinished
                age = time.time() - taken_at
                if age < ABANDONED_AFTER:
                    return self._result(letter, "replay", Outcome.REFUSED,
                                        f"{letter_label(letter)}: a replay or purge of it is in "
                                        f"progress (began {age:.0f}s ago)")
                # A replay or purge that stopped half-way: its letter goes back
                # first. Publishing a task id twice is safe for writes (the
                # journal runs it once) and allowed for reads.
                letters.put_back(letter)
                letter = letters.get(task_id) or letter
            refusal = replay_refusal(letter, force=force, reason=reason, bulk=bulk,
                                     page=via == "flower")
            refusal = refusal or self._chord_refusal(letter)
            if refusal:
                return self._result(letter, "replay", Outcome.REFUSED, refusal)
            taken = letters.take(task_id)
            if taken is None:
                return self._result(letter, "replay", Outcome.NOT_FOUND,
                                    f"{letter_label(letter)} was replayed or purged meanwhile")
            return self._replay_taken(taken, actor=actor, reason=reason, force=force,
                                      bulk=bulk, via=via)
        except STORE_ERRORS as exc:
            return ActionResult(task_id, "replay", Outcome.FAILED,
                                f"{task_id}: not replayed: {exc}")

    def _replay_taken(
        self, letter: DeadLetter, *, actor: str, reason: str, force: bool, bulk: bool, via: str,
    ) -> ActionResult:
        letters = self.runtime.dead_letters
        # The letter may have changed since it was read (a late outcome).
        refusal = replay_refusal(letter, force=force, reason=reason, bulk=bulk,
                                 page=via == "flower")
        if refusal:
            letters.put_back(letter)
            return self._result(letter, "replay", Outcome.REFUSED, refusal)
        step = self._replay_step(letter, actor=actor, reason=reason, force=force, via=via)
        unrecorded = self._record_replays([step])[0]
        if unrecorded is not None:
            return unrecorded
        result = self._publish_replay(step, actor=actor)
        if result.ok:
            with contextlib.suppress(StoreUnavailable):  # published: the copy aside is a record
                letters.forget_taken(letter.task_id)
        return result

    def _replay_step(
        self, letter: DeadLetter, *, actor: str, reason: str, force: bool, via: str,
    ) -> _ReplayStep:
        """The audited step of replaying a taken ``letter``, not yet recorded."""
        effect = letter_effect(letter)
        event = self._event(letter, "replayed", "requested", actor=actor, reason=reason,
                            force=force, via=via)
        request = None
        if effect.is_write:
            allowed = (states.REPLAY_IDEMPOTENT_FROM if effect is ToolEffect.IDEMPOTENT_WRITE
                       else states.REPLAY_FROM)
            request = ReplayRequest(
                JournalRef(letter_run_id(letter), letter.task_id), token=uuid.uuid4().hex,
                effect=effect.value, allowed=allowed, event=event,
                refuse_late_outcome=effect is ToolEffect.NON_IDEMPOTENT_WRITE,
                lapsed_running_ok=force or effect is not ToolEffect.NON_IDEMPOTENT_WRITE,
            )
        return _ReplayStep(letter, event, request)

    def _record_replays(self, steps: list[_ReplayStep]) -> list[ActionResult | None]:
        """Record each step (a write's journal reset with its event, a read's event
        alone), one round trip for the writes and one for the reads however many
        there are; None where recorded, else the ending (the letter put back)."""
        runtime = self.runtime
        endings: list[ActionResult | None] = [None] * len(steps)
        writes = [i for i, step in enumerate(steps) if step.request is not None]
        reads = [i for i, step in enumerate(steps) if step.request is None]
        requests = [step.request for step in steps if step.request is not None]
        try:
            replays: list[Any] = runtime.journal.replay_many(requests) if requests else []
        except StoreUnavailable as exc:
            replays = [exc] * len(writes)
        for i, answer in zip(writes, replays, strict=True):
            letter = steps[i].letter
            if isinstance(answer, StoreUnavailable):
                endings[i] = self._put_back(letter, Outcome.FAILED,
                                            f"{letter_label(letter)} not replayed: {answer}")
            elif not answer:
                endings[i] = self._put_back(letter, Outcome.REFUSED, journal_refusal(
                    letter, answer.previous_state, answer.detail))
        stored = runtime.audit.record_steps([steps[i].event for i in reads])
        for i, ok in zip(reads, stored, strict=True):
            if not ok:
                endings[i] = self._put_back(
                    steps[i].letter, Outcome.FAILED,
                    f"{letter_label(steps[i].letter)} not replayed: its audit event could not be "
                    "stored")
        return endings

    def _put_back(self, letter: DeadLetter, outcome: Outcome, message: str) -> ActionResult:
        """A replay that did not happen: its letter goes back to the store."""
        try:
            self.runtime.dead_letters.put_back(letter)
        except StoreUnavailable as exc:
            # Kept aside, as a replay in progress: the next replay of it resumes it.
            message += f" (the letter stays aside as a replay in progress: {exc})"
        return self._result(letter, "replay", outcome, message)

    def _publish_replay(self, step: _ReplayStep, *, actor: str) -> ActionResult:
        """Publish a recorded step's message; on failure, undo the step."""
        runtime, letter, event = self.runtime, step.letter, step.event
        try:
            member = chord_member(letter, self.accept)
            closed = member and chord_refusal(self.app, letter, member, reopen=True)
            if closed:
                raise ChordEnded(closed)
            publish(self.app, letter, mark=f"{time.time():.6f} {actor}")
        except Exception as exc:
            failed = replace(event.amended(phase="replay_failed", status="not_published"),
                             exception_type=type(exc).__qualname__)
            if step.request is not None:
                # Best effort: were it left 'replayed', no message would come anyway.
                with contextlib.suppress(StoreUnavailable):
                    runtime.journal.transition(
                        step.request.ref, new_state=JournalState.DEAD_LETTERED,
                        allowed=frozenset({JournalState.REPLAYED}), token=step.request.token,
                        event=failed, record_late=False,
                    )
            else:
                runtime.audit.record_step(failed)
            if isinstance(exc, ChordEnded):
                return self._put_back(letter, Outcome.REFUSED, str(exc))
            return self._put_back(letter, Outcome.FAILED,
                                  f"{letter_label(letter)} not published ({type(exc).__name__}: "
                                  f"{exc}); the dead letter is kept")
        return self._result(
            letter, "replay", Outcome.DONE,
            f"replayed {letter_label(letter)} ({letter.effect}) to queue {letter.queue}",
        )

    def replay_matching(
        self, query: DeadLetterQuery, *, actor: str, reason: str = "", via: str = "cli",
    ) -> Iterator[ActionResult]:
        """Replay, in bulk, every letter matching ``query`` (writes that are not idempotent
        are refused, one result each)."""
        for batch in self.runtime.dead_letters.matching_ids(query):
            yield from self._replay_batch(batch, actor=actor, reason=reason, via=via)

    def _replay_batch(
        self, task_ids: list[str], *, actor: str, reason: str, via: str,
    ) -> Iterator[ActionResult]:
        """:meth:`replay` of each of ``task_ids`` (bulk rules), each step in one
        round trip for the whole batch: read, take, record, forget; only the
        publishes go one by one. Each letter's step stays atomic and audited; a
        letter that is not simply there (a replay in progress, changed meanwhile,
        in a chord) goes the one-by-one way."""
        letters = self.runtime.dead_letters
        one_by_one: list[str] = []
        try:
            held = letters.get_many(task_ids)
        except StoreUnavailable:
            held, one_by_one = [], list(task_ids)
        candidates = []
        for task_id, entry in zip(task_ids, held, strict=False):
            if entry is None or chord_member(entry.letter, self.accept) is not None:
                one_by_one.append(task_id)
                continue
            refusal = replay_refusal(entry.letter, force=False, reason=reason, bulk=True,
                                     page=via == "flower")
            if refusal:
                yield self._result(entry.letter, "replay", Outcome.REFUSED, refusal)
            else:
                candidates.append(entry)
        try:
            taken = letters.take_many(candidates)
        except StoreUnavailable:
            taken = [False] * len(candidates)
        one_by_one += [entry.letter.task_id for entry, ok in zip(candidates, taken, strict=True)
                       if not ok]
        steps = [self._replay_step(entry.letter, actor=actor, reason=reason, force=False,
                                   via=via)
                 for entry, ok in zip(candidates, taken, strict=True) if ok]
        published = []
        for step, unrecorded in zip(steps, self._record_replays(steps), strict=True):
            result = unrecorded or self._publish_replay(step, actor=actor)
            if result.ok:
                published.append(step.letter.task_id)
            yield result
        with contextlib.suppress(StoreUnavailable):  # published: the copies aside are records
            letters.forget_taken_many(published)
        for task_id in one_by_one:
            yield self.replay(task_id, actor=actor, reason=reason, bulk=True, via=via)
