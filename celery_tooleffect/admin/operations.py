"""What operators do with dead letters: replay, purge, count, and how a letter is shown.

The CLI (:mod:`celery_tooleffect.admin.cli`) and the Flower page
(:mod:`celery_tooleffect.admin.flower`) both call :class:`DeadLetterOperations`, so
the rules below hold wherever an operator acts.

Replay
    One audited step: the letter is taken out of the store (atomically, so of
    two operators replaying the same task one wins), the journal of a write is
    reset under a new attempt token (state ``replayed``, attempt 0: the task
    has its whole attempt budget again, and any worker of an earlier attempt
    is fenced off) in the same script that appends the ``replayed`` audit
    event with the actor, the reason and the time; then the envelope is
    published again to its queue with the same task id, name, arguments, run
    id header and options (``retries`` 0). A READ_ONLY tool keeps no journal:
    its ``replayed`` event is appended alone, and the replay is not made when
    that event cannot be stored. When anything fails before the message is
    published, the letter goes back to the store and the journal back to
    ``dead_lettered``: a replay either happens, audited, or leaves things as
    they were.

    - READ_ONLY and IDEMPOTENT_WRITE may be replayed in bulk.
    - A NON_IDEMPOTENT_WRITE is replayed only by its task id, one at a time,
      with ``force`` and a reason. It is refused, even with ``force``, when its
      outcome was recorded: journal ``succeeded``, or a ``late_outcome`` (on
      the letter or in the run's audit stream).
    - A letter whose ``body_completed`` is true (``AuditPersistenceFailed``
      after the body succeeded) is refused with a message that says the write
      already ran; only ``force`` with a reason overrides that.
    - A message that could not be decoded has nothing to publish: refused.

Purge
    Removes the letter after appending a ``purged`` audit event (actor,
    reason, time); when the event cannot be stored the letter stays. The
    journal of a purged write keeps its state, so a stray copy of the message
    is still acknowledged without running until the entry expires.

Unreachable stores
    :func:`explain` turns what an action raised when a store it needs is down
    or refuses (or the broker is, or the settings are invalid) into the one
    line the CLI prints and Flower answers; :func:`store_problem` PINGs the
    stores an action needs first, and names the one that does not answer by
    its URL, without password.

Privacy
    Listings (:func:`letter_summary`) follow ``tooleffect_privacy`` like the
    audit log: at ``metadata`` they show sizes of the arguments and the error,
    never their values. Showing one letter (:func:`letter_detail`) gives the
    whole envelope, which a replay needs: whoever may show a letter may read it.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import redis
from celery.app.task import Context
from kombu.exceptions import OperationalError

from ..choices import Choice
from ..effect import ToolEffect
from ..endpoints import masked_url
from ..errors import ConfigurationError, StoreUnavailable, ToolEffectError
from ..events import AuditEvent
from ..reconciliation import ReconcileStatus, Reconciliation
from ..store import states
from ..store.audit import MASK, describe_payload, worker_identity
from ..store.chords import chord_member, chord_refusal
from ..store.dead_letters import (
    DeadLetter,
    DeadLetterQuery,
    DeadLetterReason,
    DeadLetterStats,
)
from ..store.envelope import shown
from ..store.journal import JournalRef, ReplayRequest
from ..store.runtime import ToolRuntime, runtime_for
from ..store.states import JournalState
from ..worker.attempt import RUN_ID_HEADER
from ..worker.execution import ask, reconciler

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

#: Environment variable naming who acts, for the audit (default: user@host).
ACTOR_ENV = "TOOLEFFECT_ACTOR"
#: Longest operator reason kept in an audit event, in characters.
REASON_LIMIT = 1000

#: Seconds after which a letter taken by a replay or purge that never finished
#: is taken to be abandoned (its process died), so a new replay may resume it.
ABANDONED_AFTER = 120.0

#: The Redis servers an operator's action may need (:func:`store_problem`): the
#: store (journal, audit log, approvals: ``tooleffect_redis_url``) and the
#: dead-letter store (the broker's Redis when the broker is Redis).
STORE = "store"
DEAD_LETTER_STORE = "dead-letter store"
BOTH_STORES = (STORE, DEAD_LETTER_STORE)
#: What a store that is down or refuses raises: the package's error, or redis-py's.
STORE_ERRORS: tuple[type[Exception], ...] = (
    StoreUnavailable, redis.RedisError, redis.exceptions.RedisClusterException,
)
#: What a broker that is down raises (kombu's wrapper, or the socket's own).
BROKER_ERRORS: tuple[type[Exception], ...] = (OperationalError, ConnectionError)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def store_problem(
    runtime: ToolRuntime, needs: Iterable[str] = BOTH_STORES,
    error: BaseException | None = None,
) -> str | None:
    """One line naming the first store of ``needs`` (:data:`STORE`,
    :data:`DEAD_LETTER_STORE`) that does not answer a PING, by its URL without
    password, and its error; None when each answers.

    With ``error`` (what an action raised) it is never None: when every store
    answers again, the line names them all, with that error.
    """
    settings = runtime.settings
    same = settings.dead_letter_url == settings.redis_url
    servers: dict[str, tuple[str, Callable[[], redis.Redis]]] = {}
    for need in needs:
        if need == STORE or same:
            servers.setdefault(settings.redis_url, (STORE, lambda: runtime.audit.client))
        else:
            servers.setdefault(settings.dead_letter_url,
                               (DEAD_LETTER_STORE, lambda: runtime.dead_letters.client))
    for url, (label, client) in servers.items():
        try:
            client().ping()
        except STORE_ERRORS as exc:
            return f"the {label} {masked_url(url)} is unavailable: {_one_line(exc)}"
    if error is None:
        return None
    named = " or ".join(f"the {label} {masked_url(url)}"
                        for url, (label, _) in servers.items())
    return f"{named or 'the store'} failed: {_one_line(error)}"


def explain(app: Celery, error: BaseException, needs: Iterable[str] = BOTH_STORES) -> str | None:
    """The one line an operator is told when ``error`` ended an action: the app's
    settings are invalid, a store of ``needs`` is down or refuses
    (:func:`store_problem`), or the broker is down; None for any other error."""
    if isinstance(error, ConfigurationError):
        return f"invalid celery-tooleffect settings: {_one_line(error)}"
    if isinstance(error, STORE_ERRORS):
        return store_problem(runtime_for(app), needs, error)
    if isinstance(error, BROKER_ERRORS):
        broker = masked_url(runtime_for(app).settings.broker_url)
        return f"the broker {broker} is unavailable: {_one_line(error)}"
    return None


def default_actor() -> str:
    """Who acts from this process: ``$TOOLEFFECT_ACTOR``, else ``user@host``."""
    named = os.environ.get(ACTOR_ENV, "").strip()
    if named:
        return named
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


class Outcome(Choice):
    """How one operator action on one letter ended."""

    __choice_name__ = "an action outcome"

    DONE = "done"
    REFUSED = "refused"
    NOT_FOUND = "not_found"
    FAILED = "failed"


@dataclass(frozen=True)
class ActionResult:
    """The result of replaying, purging or reconciling one task."""

    task_id: str
    action: str
    outcome: Outcome
    message: str
    name: str = ""
    effect: str = ""
    queue: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.DONE

    def to_dict(self) -> dict[str, str]:
        return {
            "task_id": self.task_id,
            "action": self.action,
            "outcome": self.outcome.value,
            "message": self.message,
            "name": self.name,
            "effect": self.effect,
            "queue": self.queue,
        }


def letter_effect(letter: DeadLetter) -> ToolEffect:
    """The effect of a letter's task (an unreadable one counts as NON_IDEMPOTENT_WRITE)."""
    try:
        return ToolEffect.coerce(letter.effect)
    except (ValueError, TypeError):
        return ToolEffect.NON_IDEMPOTENT_WRITE


def _label(letter: DeadLetter) -> str:
    return f"{letter.name or '<no task name>'}[{letter.task_id}]"


def replay_refusal(
    letter: DeadLetter, *, force: bool, reason: str, bulk: bool,
    journal_state: str | None = None,
) -> str | None:
    """Why ``letter`` may not be replayed this way, or None when it may.

    ``journal_state`` (when known) lets a caller preview the journal's verdict;
    the replay itself checks the journal atomically.
    """
    label = _label(letter)
    effect = letter_effect(letter)
    if not letter.name or (
        letter.message is None and letter.reason == DeadLetterReason.UNDECODABLE_MESSAGE.value
    ):
        return (
            f"{label} cannot be replayed: its message names no task that could be "
            "published (the body is kept in the dead letter); purge it once handled"
        )
    if letter.reason == DeadLetterReason.CALL_ID_CONFLICT.value:
        return (
            f"{label} cannot be replayed: its task id belongs to another call "
            f"({letter.error}); publish it again under its own id, then purge this letter"
        )
    if force and not reason.strip():
        return f"{label}: a forced replay needs a reason (--reason): it is audited with why"
    if effect is ToolEffect.NON_IDEMPOTENT_WRITE:
        if bulk:
            return (
                f"{label} is a NON_IDEMPOTENT_WRITE: it is replayed only by its task id, one "
                "at a time, with --force and a --reason; never in bulk"
            )
        recorded = _recorded_outcome(letter, journal_state)
        if recorded:
            return (
                f"{label} is a NON_IDEMPOTENT_WRITE whose outcome was recorded ({recorded}): "
                "the write ran, and it is not replayed"
            )
    if letter.body_completed and not force:
        return (
            f"the write already ran: {label} completed its body, but its outcome could not "
            "be recorded (AuditPersistenceFailed). Replaying it runs the write a second "
            "time. Only --force with a --reason overrides this."
        )
    if effect is ToolEffect.NON_IDEMPOTENT_WRITE and not force:
        return (
            f"{label} is a NON_IDEMPOTENT_WRITE ({letter.reason}): its write may already have "
            "happened. Replay it only with --force and a --reason."
        )
    return None


def _recorded_outcome(letter: DeadLetter, journal_state: str | None) -> str:
    if journal_state == JournalState.SUCCEEDED.value:
        return "journal: succeeded"
    for late in letter.late_outcomes:
        status = late.get("status") or late.get("late_phase") or "?"
        return f"late outcome: {status}"
    return ""


def letter_summary(letter: DeadLetter, privacy: str, accept: Any = None) -> dict[str, Any]:
    """One listed letter, as the stable JSON of ``dlq list`` and ``/api/dead-letters``.

    Arguments (decoded from the body with ``accept``, the app's
    ``accept_content``) and the error message follow ``privacy``: at
    ``metadata`` only their sizes (``args_size``, ``kwargs_size``,
    ``error_size``). A body that cannot be decoded adds ``decode_error``.
    """
    summary: dict[str, Any] = {
        "task_id": letter.task_id,
        "name": letter.name,
        "queue": letter.queue,
        "reason": letter.reason,
        "failure_class": letter.failure_class,
        "effect": letter.effect,
        "exception_type": letter.exception_type,
        "attempts": letter.attempts,
        "worker": letter.worker,
        "run_id": letter.run_id,
        "body_completed": letter.body_completed,
        "late_outcomes": len(letter.late_outcomes),
        "dead_lettered_at": letter.dead_lettered_at,
    }
    args, kwargs, _, problem = _decoded_payload(letter, accept)
    if problem:
        summary["decode_error"] = problem
    for name, value in describe_payload(privacy, args=shown(args), kwargs=shown(kwargs)).items():
        summary[name] = int(value) if name.endswith("_size") else value
    if privacy == "full":
        summary["error"] = letter.error
    elif privacy == "redacted":
        summary["error"] = MASK if letter.error else ""
    else:
        summary["error_size"] = len(letter.error.encode("utf-8", "replace"))
    return summary


def letter_detail(
    letter: DeadLetter, journal: dict[str, str] | None, *, taken: bool = False,
    accept: Any = None, chord_refusal: str | None = None,
) -> dict[str, Any]:
    """One letter in full, as the stable JSON of ``dlq show`` and ``/api/dead-letters/<id>``.

    ``dead_letter`` is :func:`letter_view`. ``replay`` previews the rules:
    ``allowed`` (without force), ``needs_force`` and the ``refusal`` a plain
    replay would get.
    """
    state = (journal or {}).get("state")
    plain = chord_refusal or replay_refusal(letter, force=False, reason="", bulk=False,
                                            journal_state=state)
    forced = chord_refusal or replay_refusal(letter, force=True, reason="why", bulk=False,
                                             journal_state=state)
    bulk = chord_refusal or replay_refusal(letter, force=False, reason="", bulk=True,
                                           journal_state=state)
    return {
        "dead_letter": letter_view(letter, accept),
        "journal": journal or None,
        "replay_in_progress": taken,
        "replay": {
            "allowed": plain is None,
            "needs_force": plain is not None and forced is None,
            "bulk": bulk is None,
            "refusal": plain,
        },
    }


def letter_view(letter: DeadLetter, accept: Any = None) -> dict[str, Any]:
    """A letter as operators see it: JSON-safe, decoded for display only.

    ``args``, ``kwargs`` and ``canvas`` (callbacks, errbacks, chain, chord)
    are decoded from the kept body with kombu's serializers for the content
    types ``accept`` allows; a value JSON has no type for is shown as
    ``{"$text": repr, "$type": type}``. ``message`` shows the headers,
    properties and routing as delivered and the body's size; the body itself
    (base64) only when it could not be decoded. Nothing shown is written back.
    """
    data = letter.to_dict()
    message = data.pop("message")
    args, kwargs, embed, problem = _decoded_payload(letter, accept)
    data.update(args=shown(args), kwargs=shown(kwargs),
                canvas=shown({key: value for key, value in embed.items() if value}),
                decode_error=problem)
    if letter.message is not None:
        envelope = letter.message
        data["message"] = {
            "protocol": envelope.protocol,
            "content_type": envelope.content_type,
            "content_encoding": envelope.content_encoding,
            "headers": shown(dict(envelope.headers)),
            "properties": shown(dict(envelope.properties)),
            "exchange": envelope.exchange,
            "routing_key": envelope.routing_key,
            "body_size": len(envelope.body),
            "body_base64": message["body"] if problem else None,
        }
    else:
        data["message"] = None
    return data


def _decoded_payload(
    letter: DeadLetter, accept: Any
) -> tuple[list[Any], dict[str, Any], dict[str, Any], str | None]:
    """``(args, kwargs, embed, problem)``: the decoded body, or empty values and why not.

    ``accept`` None means Celery's default (JSON only), never "anything".
    """
    try:
        args, kwargs, embed = letter.payload(accept if accept is not None else ("json",))
    except Exception as exc:
        return [], {}, {}, f"body not decoded: {type(exc).__name__}: {exc}"
    return args, kwargs, embed, None


class DeadLetterOperations:
    """Replay, purge and count the dead letters of one app (see the module docs)."""

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

    def detail(self, task_id: str) -> dict[str, Any] | None:
        """:func:`letter_detail` of ``task_id``'s letter (or of one being replayed), or None."""
        letters = self.runtime.dead_letters
        letter = letters.get(task_id)
        taken = False
        if letter is None:
            unfinished = letters.taken(task_id)
            if unfinished is None:
                return None
            letter, taken = unfinished[0], True
        detail = letter_detail(letter, self._journal(letter), taken=taken, accept=self.accept,
                               chord_refusal=self._chord_refusal(letter))
        declared = reconciler(self.app.tasks.get(letter.name)) is not None
        detail["reconcile"] = {"refusal": reconcile_refusal(letter, declared=declared)}
        return detail

    def _chord_refusal(self, letter: DeadLetter) -> str | None:
        """Why a replay of ``letter`` could not complete its chord (None: not in one, or it can)."""
        member = chord_member(letter, self.accept)
        if member is None:
            return None
        try:
            return chord_refusal(self.app, letter, member, reopen=False)
        except Exception as exc:  # the result backend did not answer
            return f"{_label(letter)}: its chord {member.group_id} could not be checked: {exc}"

    def _journal(self, letter: DeadLetter) -> dict[str, str] | None:
        if not letter_effect(letter).is_write:
            return None
        try:
            return self.runtime.journal.read(JournalRef(_run_id(letter), letter.task_id)) or None
        except StoreUnavailable:
            return None

    # -- replay ------------------------------------------------------------------

    def replay(
        self, task_id: str, *, actor: str, reason: str = "", force: bool = False,
        bulk: bool = False, via: str = "cli",
    ) -> ActionResult:
        """Replay one dead letter under the rules of the module docs."""
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
                                        f"{_label(letter)}: a replay or purge of it is in "
                                        f"progress (began {age:.0f}s ago)")
                # A replay or purge that stopped half-way: its letter goes back
                # first. Publishing a task id twice is safe for writes (the
                # journal runs it once) and allowed for reads.
                letters.put_back(letter)
                letter = letters.get(task_id) or letter
            refusal = replay_refusal(letter, force=force, reason=reason, bulk=bulk)
            refusal = refusal or self._chord_refusal(letter)
            if refusal:
                return self._result(letter, "replay", Outcome.REFUSED, refusal)
            taken = letters.take(task_id)
            if taken is None:
                return self._result(letter, "replay", Outcome.NOT_FOUND,
                                    f"{_label(letter)} was replayed or purged meanwhile")
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
        refusal = replay_refusal(letter, force=force, reason=reason, bulk=bulk)
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
                JournalRef(_run_id(letter), letter.task_id), token=uuid.uuid4().hex,
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
                                            f"{_label(letter)} not replayed: {answer}")
            elif not answer:
                endings[i] = self._put_back(letter, Outcome.REFUSED, _journal_refusal(
                    letter, answer.previous_state, answer.detail))
        stored = runtime.audit.record_steps([steps[i].event for i in reads])
        for i, ok in zip(reads, stored, strict=True):
            if not ok:
                endings[i] = self._put_back(
                    steps[i].letter, Outcome.FAILED,
                    f"{_label(steps[i].letter)} not replayed: its audit event could not be "
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
                                  f"{_label(letter)} not published ({type(exc).__name__}: "
                                  f"{exc}); the dead letter is kept")
        return self._result(
            letter, "replay", Outcome.DONE,
            f"replayed {_label(letter)} ({letter.effect}) to queue {letter.queue}",
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
            refusal = replay_refusal(entry.letter, force=False, reason=reason, bulk=True)
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

    # -- reconcile ---------------------------------------------------------------

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
        check = reconciler(tool)
        refusal = reconcile_refusal(letter, declared=check is not None)
        if refusal or check is None:
            return self._result(letter, "reconcile", Outcome.REFUSED,
                                refusal or f"{_label(letter)}: no reconcile")
        try:
            args, kwargs, _ = letter.payload(self.accept)
        except Exception as exc:
            return self._result(letter, "reconcile", Outcome.FAILED,
                                f"{_label(letter)}: its arguments could not be read "
                                f"({type(exc).__name__}: {exc})")
        run_id = _run_id(letter)
        # The run id as the task's root: self.idempotency_key derives the same key.
        request = Context(id=letter.task_id, root_id=run_id, called_directly=False)
        answer, problem = ask(check, tool, request, tuple(args), kwargs,
                              timeout=runtime.settings.reconcile_timeout)
        status = ReconcileStatus.FAILED if answer is None else answer.status
        evidence = answer.evidence if answer is not None else (
            f"{type(problem).__name__}: {problem}")
        event = self._event(letter, "reconcile", status.value, actor=actor, reason="",
                            force=False, via=via)
        event = replace(event.amended(**describe_payload(self.privacy, evidence=evidence)),
                        exception_type=None if problem is None else type(problem).__qualname__)
        seen = f"{_label(letter)}: reconcile answered {status.value} ({evidence or 'no evidence'})"
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
                    JournalRef(_run_id(letter), letter.task_id),
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
            logger.warning("%s: result not stored on the backend: %s", _label(letter), exc)
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

    # -- purge -------------------------------------------------------------------

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
                                    f"{_label(letter)} not purged: its audit event could not "
                                    "be stored")
            letters.forget_taken(task_id)
        except StoreUnavailable as exc:
            return ActionResult(task_id, "purge", Outcome.FAILED, f"{task_id}: not purged: {exc}")
        return self._result(letter, "purge", Outcome.DONE, f"purged {_label(letter)}")

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
                yield self._result(letter, "purge", Outcome.DONE, f"purged {_label(letter)}")
                continue
            with contextlib.suppress(StoreUnavailable):  # else kept aside, as in progress
                letters.put_back(letter)
            yield self._result(letter, "purge", Outcome.FAILED,
                               f"{_label(letter)} not purged: its audit event could not be "
                               "stored")
        with contextlib.suppress(StoreUnavailable):
            letters.forget_taken_many(purged)
        for task_id in task_ids:
            if task_id not in mine_ids:
                yield self.purge(task_id, actor=actor, reason=reason, via=via)

    def count_matching(self, query: DeadLetterQuery, *, older_than: float | None = None) -> int:
        """How many letters a bulk action on ``query`` would touch (walks only the matches)."""
        cutoff = None if older_than is None else time.time() - max(older_than, 0.0)
        return sum(len(batch) for batch in
                   self.runtime.dead_letters.matching_ids(query, older_than=cutoff))

    # -- helpers -----------------------------------------------------------------

    def _event(
        self, letter: DeadLetter, phase: str, status: str, *, actor: str, reason: str,
        force: bool, via: str,
    ) -> AuditEvent:
        """The audit event of an operator's action on ``letter``."""
        return AuditEvent.of(
            run_id=_run_id(letter),
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


#: Dead-letter reasons whose write may have happened: what reconcile is for.
RECONCILABLE = frozenset({
    DeadLetterReason.INTERRUPTED_WRITE.value, DeadLetterReason.REVOKED.value,
})


@dataclass(frozen=True)
class _ReplayStep:
    """One taken letter's replay: its ``replayed`` event and, for a write, the
    journal reset that stores that event."""

    letter: DeadLetter
    event: AuditEvent
    request: ReplayRequest | None


def reconcile_refusal(letter: DeadLetter, *, declared: bool) -> str | None:
    """Why ``letter`` cannot be reconciled, or None when it can."""
    label = _label(letter)
    if not declared:
        return (f"{label}: its tool declares no reconcile (or is not registered in this "
                "app): nothing can tell whether its write happened")
    outcome_lost = letter.exception_type == "AuditPersistenceFailed"
    if letter.reason not in RECONCILABLE and not outcome_lost:
        return (f"{label} is a dead letter {letter.reason}: its write did not start or its "
                "outcome is known; there is nothing to reconcile")
    return None


def _journal_refusal(letter: DeadLetter, state: str, detail: str) -> str:
    label = _label(letter)
    if state == "late_outcome":
        return (f"{label} is a NON_IDEMPOTENT_WRITE whose outcome was recorded (late outcome: "
                f"{detail or '?'}): the write ran, and it is not replayed")
    if state == JournalState.SUCCEEDED.value:
        return (f"{label} is a NON_IDEMPOTENT_WRITE whose outcome was recorded (journal: "
                "succeeded): the write ran, and it is not replayed")
    if state == JournalState.RUNNING.value:
        return f"{label}: an attempt of it is running now (journal: running); not replayed"
    return f"{label}: its journal is in state {state!r}, not a dead letter's; not replayed"


def _run_id(letter: DeadLetter) -> str:
    return str(letter.run_id or letter.headers_as_delivered.get(RUN_ID_HEADER) or letter.task_id)


class ChordEnded(ToolEffectError):
    """The chord of a replayed member ended meanwhile; the replay is refused."""


def publish(app: Celery, letter: DeadLetter, *, mark: str) -> None:
    """Publish ``letter``'s message again, as :meth:`MessageEnvelope.replayed` says:
    the same bytes, headers and properties, to the same exchange and routing key,
    with ``retries`` 0, no ``eta`` or ``expires``, and the replay ``mark``.

    The app's queue of that name is declared first when the app knows it.
    A letter of envelope version 1 (no message kept) is published as it
    always was: a new message with its name, arguments, run id and options.
    """
    if letter.message is None:
        _publish_version_1(app, letter)
        return
    message = letter.message.replayed(mark)
    queue = app.amqp.queues.get(letter.queue)
    with app.producer_or_acquire() as producer:
        message.publish(producer, declare=[queue] if queue is not None else [])


def _publish_version_1(app: Celery, letter: DeadLetter) -> None:
    options = letter.v1_options
    extra: dict[str, Any] = {}
    for name in ("root_id", "parent_id", "priority"):
        if options.get(name) is not None:
            extra[name] = options[name]
    app.send_task(
        letter.name,
        args=list(letter.v1_args),
        kwargs=dict(letter.v1_kwargs),
        task_id=letter.task_id,
        queue=letter.queue,
        headers={RUN_ID_HEADER: _run_id(letter)},
        retries=0,
        **extra,
    )


def results_summary(results: Iterable[ActionResult]) -> dict[str, Any]:
    """The stable JSON of ``dlq replay --json`` and ``dlq purge --json``."""
    listed = [result.to_dict() for result in results]
    counts = {outcome.value: 0 for outcome in Outcome}
    for result in listed:
        counts[result["outcome"]] += 1
    return {"results": listed, **counts}
