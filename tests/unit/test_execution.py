"""How one call ends (celery_tooleffect/worker/execution.py), decided in-process.

:class:`~celery_tooleffect.worker.execution.Execution` is driven here by a
fake store: :class:`FakeJournal` answers ``begin_attempt`` with the verdict a
test chooses and records every move asked of it; the audit log, dead letters,
approvals and broker leases are fakes likewise; the tool is a
:class:`FakeTool` with the package's real :class:`RetryPolicy`, real settings
and real failure classifier. The fakes are only a way to reach every decision
of the protocol (every verdict, failure, store outage and interactive run) in
milliseconds, and to read the decision: which ending is raised, which journal
move is asked for, from which states, with which owner token.

They prove nothing about what the store does with those moves. That a write
never runs twice, that nothing is lost and that the fencing holds is proved
only by the real-process tests, on real Redis and RabbitMQ and real worker
processes killed at every step (tests/test_outcomes.py,
tests/test_interruptions.py, tests/test_leases.py, tests/faults/, the crash
test); this file never stands in for them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.threads import LocalStack
from kombu.exceptions import EncodeError

from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.errors import (
    ApprovalRequired,
    AttemptInProgress,
    AuditPersistenceFailed,
    CallIdConflict,
    DeadLettered,
    EffectRelabelRefused,
    IntentNotDurable,
    IntentNotRecorded,
    LeaseLost,
    NoSideEffect,
    ResultNotStorable,
    StoreUnavailable,
)
from celery_tooleffect.events import AuditEvent
from celery_tooleffect.failures import FailureClassifier
from celery_tooleffect.identity import call_digest
from celery_tooleffect.reconciliation import Reconciliation
from celery_tooleffect.settings import Settings, settings_for
from celery_tooleffect.store import states
from celery_tooleffect.store.dead_letter_record import DeadLetter, conflict_letter_id
from celery_tooleffect.store.journal import Begin, Transition
from celery_tooleffect.store.leases import Leases, LeaseVerdict
from celery_tooleffect.store.states import ApprovalState, Ending, JournalState, Verdict
from celery_tooleffect.worker.execution import Execution
from celery_tooleffect.worker.handoff import HANDOFF_FIELD, Handoff, attempt_notes, existing_notes
from celery_tooleffect.worker.retries import RetryPolicy
from tests.unit.conftest import app_with

READ = ToolEffect.READ_ONLY
IDEMPOTENT = ToolEffect.IDEMPOTENT_WRITE
WRITE = ToolEffect.NON_IDEMPOTENT_WRITE

#: Budget 2 (three attempts), backoff 1 s doubling to 8 s, visibility timeout 60 s.
SETTINGS = settings_for(app_with(
    tooleffect_max_retries=2, tooleffect_backoff_base=1.0, tooleffect_backoff_cap=8.0,
    tooleffect_reconcile_timeout=0.2, broker_transport_options={"visibility_timeout": 60}))
RABBITMQ_SETTINGS = settings_for(app_with(
    broker_url="amqp://guest@h/te-unit", tooleffect_redis_url="redis://127.0.0.1:1/0",
    tooleffect_rabbitmq_consumer_timeout=100, tooleffect_max_retries=2))


# -- the fakes (see the module docstring: decisions only, never guarantees) ---------


def _next(answers: list[Any]) -> Any:
    """The next scripted answer; the last one answers every call after it."""
    answer = answers.pop(0) if len(answers) > 1 else answers[0]
    if isinstance(answer, BaseException):
        raise answer
    return answer


@dataclass
class FakeJournal:
    #: What begin_attempt answers, in order (a Begin, or an exception it raises).
    verdicts: list[Any] = field(default_factory=lambda: [started()])
    #: What each transition answers: moved or not, or an exception.
    moved: list[Any] = field(default_factory=lambda: [True])
    #: The entry read() returns (or an exception it raises).
    entry: Any = field(default_factory=dict)
    recorded: Any = None
    begins: list[dict[str, Any]] = field(default_factory=list)
    moves: list[dict[str, Any]] = field(default_factory=list)

    def begin_attempt(self, ref: Any, **arguments: Any) -> Begin:
        self.begins.append(arguments)
        return Begin(**vars(_next(self.verdicts)))

    def transition(self, ref: Any, **arguments: Any) -> Transition:
        self.moves.append(arguments)
        return Transition(bool(_next(self.moved)), "running")

    def read(self, ref: Any) -> dict[str, str]:
        if isinstance(self.entry, BaseException):
            raise self.entry
        return dict(self.entry)

    def recorded_effect(self, ref: Any) -> ToolEffect | None:
        if isinstance(self.recorded, BaseException):
            raise self.recorded
        return self.recorded  # type: ignore[no-any-return]

    def renew_lease(self, ref: Any, **arguments: Any) -> bool:
        return True

    def states_moved_to(self) -> list[JournalState]:
        return [move["new_state"] for move in self.moves]


@dataclass
class FakeAudit:
    stored: bool = True
    events: list[AuditEvent] = field(default_factory=list)
    copies: list[AuditEvent] = field(default_factory=list)

    def record_step(self, event: AuditEvent, result: Any = None, ack: Any = None) -> bool:
        self.events.append(event)
        return self.stored

    def copy_to_global(self, event: AuditEvent) -> None:
        self.copies.append(event)

    def phases(self) -> list[tuple[str, str]]:
        return [(event.phase, event.status) for event in self.events]


@dataclass
class FakeDeadLetters:
    exists_answer: Any = False
    late: list[tuple[str, AuditEvent]] = field(default_factory=list)

    def record_late_outcome(self, task_id: str, event: AuditEvent) -> None:
        self.late.append((task_id, event))

    def exists(self, task_id: str) -> bool:
        if isinstance(self.exists_answer, BaseException):
            raise self.exists_answer
        return bool(self.exists_answer)


@dataclass
class FakeApprovals:
    answer: ApprovalState = ApprovalState.ABSENT

    def decision(self, run_id: str, task_id: str) -> tuple[ApprovalState, str]:
        return self.answer, ""


@dataclass
class FakeLeases:
    lease: Any = None
    reaches_the_broker: bool = False
    verdict: LeaseVerdict = LeaseVerdict.OK
    extended: list[float] = field(default_factory=list)

    def broker_ack(self, properties: Any) -> None:
        return None

    def broker_lease(self, properties: Any) -> Any:
        return self.lease

    def extend_lease(self, lease: Any, until: float) -> LeaseVerdict:
        self.extended.append(until)
        return self.verdict


@dataclass
class FakeRuntime:
    settings: Settings = SETTINGS
    journal: FakeJournal = field(default_factory=FakeJournal)
    audit: FakeAudit = field(default_factory=FakeAudit)
    dead_letters: FakeDeadLetters = field(default_factory=FakeDeadLetters)
    approvals: FakeApprovals = field(default_factory=FakeApprovals)
    leases: FakeLeases = field(default_factory=FakeLeases)
    classifier: FailureClassifier = field(default_factory=FailureClassifier)


class FakeSignature:
    def __init__(self, tool: FakeTool, options: dict[str, Any]) -> None:
        self.tool, self.options = tool, options
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}

    def apply_async(self) -> None:
        if self.tool.publish_fails:
            raise ConnectionError("broker down")
        self.tool.published.append(self.options)


class FakeTool:
    """What Execution reads of a tool (the ``Tool`` protocol); its retry policy
    is the package's own, built from these attributes as for a ToolTask."""

    name = "tools.t"

    def __init__(self, body: Callable[..., Any], effect: ToolEffect = READ, *,
                 runtime: FakeRuntime | None = None, deadline: float | None = None,
                 approval: bool = False, **declared: Any) -> None:
        self.runtime = runtime or FakeRuntime()
        self.tool_effect = effect
        self.operation_deadline = deadline
        self.approval = approval
        self.ignore_result = True  # Celery stores the result (none kept by the outcome)
        self.request_stack = LocalStack()
        self.published: list[dict[str, Any]] = []
        self.publish_fails = False
        self.run = body
        for name, value in declared.items():
            setattr(self, name, value)
        self.retry_policy = RetryPolicy.of(self, self.runtime.settings, effect)

    def signature_from_request(self, request: Any, **options: Any) -> FakeSignature:
        return FakeSignature(self, options)

    def needs_approval(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return self.approval


TASK_ID = "00000000-0000-4000-8000-000000000001"


def request(*, interactive: bool = False, approved: bool = False,
            forged: tuple[str, ...] = (), **fields: Any) -> Context:
    """A queued delivery's request, with the hand-off of the worker's main
    process (its owner token; ``approved``, ``forged``: what it found); with
    ``interactive``, an ``apply()`` (no hand-off)."""
    base: dict[str, Any] = {
        "id": TASK_ID, "retries": 0, "is_eager": interactive, "called_directly": False,
        "delivery_info": {"routing_key": "tools", "redelivered": False},
        "properties": {}, "headers": {}, "root_id": None, "ignore_result": None,
    }
    if not interactive or approved:
        base[HANDOFF_FIELD] = Handoff(token=f"tok-{uuid.uuid4().hex}", forged=forged,
                                      approved=approved)
    base.update(fields)
    return Context(base)


def started(attempt: int = 1, **fields: Any) -> Begin:
    return Begin(Verdict.STARTED, attempt, "", fencing_token=attempt + 6, **fields)


def verdict(answer: Verdict, attempt: int = 1, detail: str = "", **fields: Any) -> Begin:
    return Begin(answer, attempt, detail, **fields)


def run(tool: FakeTool, *args: Any, req: Context | None = None, **kwargs: Any) -> Any:
    return Execution(tool, req or request(), args, kwargs).run()  # type: ignore[arg-type]


def body(result: Any = "done") -> Callable[..., Any]:
    calls: list[tuple[Any, ...]] = []

    def run_body(key: str = "k") -> Any:
        calls.append((key,))
        return result

    run_body.calls = calls  # type: ignore[attr-defined]
    return run_body


def failing(exc: BaseException) -> Callable[..., Any]:
    def run_body(key: str = "k") -> Any:
        raise exc

    return run_body


def letter_of(ending: DeadLettered) -> DeadLetter:
    assert ending.pending_letter is not None
    letter: DeadLetter = ending.pending_letter.letter
    return letter


# -- a read --------------------------------------------------------------------------


def test_a_read_runs_once_and_its_outcome_is_audited_without_a_journal() -> None:
    tool = FakeTool(body("r"))
    assert run(tool, "k") == "r"
    assert tool.run.calls == [("k",)]  # type: ignore[attr-defined]
    assert tool.runtime.audit.phases() == [("outcome", "succeeded")]
    assert tool.runtime.journal.begins == [] and tool.runtime.journal.moves == []


def test_a_read_whose_audit_is_not_stored_still_answers() -> None:
    tool = FakeTool(body("r"), runtime=FakeRuntime(audit=FakeAudit(stored=False)))
    assert run(tool) == "r"


def test_a_retryable_failure_of_a_read_is_retried_with_the_backoff() -> None:
    tool = FakeTool(failing(ConnectionError("provider down")))
    with pytest.raises(Retry) as ended:
        run(tool, req=request(retries=1))
    assert ended.value.when == SETTINGS.backoff(1) == 2.0
    assert isinstance(ended.value.exc, ConnectionError)
    assert tool.published == [{"countdown": 2.0, "retries": 2}]
    assert tool.runtime.audit.phases() == [("outcome", "failed")]
    assert tool.runtime.audit.events[0].failure_class == "connection"


def test_a_read_that_spent_its_budget_is_a_dead_letter() -> None:
    tool = FakeTool(failing(ConnectionError("provider down")))
    with pytest.raises(DeadLettered) as ended:
        run(tool, req=request(retries=2))  # attempt 3 of a budget of 2 retries
    assert ended.value.dead_letter_reason == "retries_exhausted"
    letter = letter_of(ended.value)
    assert (letter.attempts, letter.failure_class, letter.effect) == (3, "connection", "read_only")
    assert tool.published == []
    # A read is not journalled: its dead letter's outcome goes to the audit log.
    assert tool.runtime.journal.moves == []
    assert set(tool.runtime.audit.phases()) == {("outcome", "failed")}


def test_a_read_s_failure_is_audited_once() -> None:
    """Found by this layer (and seen on a real worker): a read that ended as a
    dead letter recorded its failed outcome twice."""
    tool = FakeTool(failing(ValueError("bad input")))
    with pytest.raises(DeadLettered):
        run(tool)
    assert tool.runtime.audit.phases() == [("outcome", "failed")]


def test_an_unknown_failure_is_never_retried() -> None:
    tool = FakeTool(failing(ValueError("bad input")))
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert ended.value.dead_letter_reason == "not_retryable"
    assert ended.value.failure_class == "unknown"
    # Celery's result shows the body's own error.
    assert isinstance(ended.value.error, ValueError)
    assert isinstance(ended.value.__cause__, ValueError)
    letter = letter_of(ended.value)
    assert (letter.exception_type, letter.error, letter.task_id) == (
        "ValueError", "bad input", TASK_ID)


def test_an_interactive_failure_is_raised_as_itself_with_its_class() -> None:
    failure = ConnectionError("down")
    tool = FakeTool(failing(failure))
    req = request(interactive=True)
    with pytest.raises(ConnectionError) as ended:
        run(tool, req=req)
    assert ended.value is failure
    assert failure.__dict__["failure_class"] == "connection"
    # Audited: noted in the attempt's notes, nothing else marked on the error.
    notes = existing_notes(req)
    assert notes is not None and notes.audited is failure
    assert set(failure.__dict__) == {"failure_class"}
    assert tool.published == []  # never retried


def test_a_retry_that_cannot_be_published_keeps_the_message() -> None:
    tool = FakeTool(failing(ConnectionError("down")))
    tool.publish_fails = True
    with pytest.raises(Reject) as ended:
        run(tool)
    assert ended.value.requeue is True
    assert isinstance(ended.value.__cause__, ConnectionError)


def test_autoretry_for_retries_what_it_names_with_its_countdown() -> None:
    tool = FakeTool(failing(KeyError("x")), autoretry_for=(KeyError,),
                    retry_kwargs={"countdown": 7})
    with pytest.raises(Retry) as ended:
        run(tool)
    assert ended.value.when == 7.0
    # dont_autoretry_for wins, even over a retryable class.
    tool = FakeTool(failing(ConnectionResetError("x")), dont_autoretry_for=(ConnectionError,))
    with pytest.raises(DeadLettered) as refused:
        run(tool)
    assert refused.value.dead_letter_reason == "not_retryable"


def test_a_retry_the_tool_asks_for_is_audited_and_raised() -> None:
    asked = Retry(exc=ValueError("later"), when=5)
    tool = FakeTool(failing(asked))
    with pytest.raises(Retry) as ended:
        run(tool)
    assert ended.value is asked
    event = tool.runtime.audit.events[-1]
    assert (event.phase, event.status) == ("outcome", "retrying")
    assert event.details["requested"] == "1" and event.details["countdown"] == "5"


def test_a_retry_asked_for_after_the_budget_is_a_dead_letter() -> None:
    spent = ValueError("still failing")
    req = request(retries=2)
    attempt_notes(req).retries_spent = (spent, 2)
    tool = FakeTool(failing(spent))
    with pytest.raises(DeadLettered) as ended:
        run(tool, req=req)
    assert ended.value.dead_letter_reason == "retries_exhausted"
    assert "asked for a retry (self.retry()) after 2 retries" in letter_of(ended.value).error
    assert ended.value.error is spent


def test_only_the_error_retry_raised_with_the_budget_spent_says_so() -> None:
    """The attempt's notes name the very error ``self.retry()`` raised: another
    error the body raised after catching it is decided as any failure."""
    req = request(retries=2)
    attempt_notes(req).retries_spent = (ValueError("caught by the body"), 2)
    tool = FakeTool(failing(ValueError("raised instead")))
    with pytest.raises(DeadLettered) as ended:
        run(tool, req=req)
    assert ended.value.dead_letter_reason == "not_retryable"


def test_a_read_delivered_again_that_a_release_recorded_as_a_write_runs_as_one() -> None:
    runtime = FakeRuntime(journal=FakeJournal(recorded=WRITE))
    tool = FakeTool(body("w"), runtime=runtime)
    redelivered = request(delivery_info={"routing_key": "tools", "redelivered": True})
    assert run(tool, req=redelivered) == "w"
    assert runtime.journal.begins[0]["effect"] == "non_idempotent_write"
    assert runtime.journal.states_moved_to() == [JournalState.SUCCEEDED]


def test_a_first_delivery_of_a_read_never_asks_the_journal() -> None:
    runtime = FakeRuntime(journal=FakeJournal(recorded=StoreUnavailable("down")))
    assert run(FakeTool(body("r"), runtime=runtime)) == "r"


def test_a_read_delivered_again_waits_when_its_recorded_effect_cannot_be_read() -> None:
    runtime = FakeRuntime(journal=FakeJournal(recorded=StoreUnavailable("down")))
    tool = FakeTool(body("r"), runtime=runtime)
    with pytest.raises(Retry) as ended:
        run(tool, req=request(retries=1))
    assert isinstance(ended.value.exc, IntentNotRecorded)
    assert tool.run.calls == []  # type: ignore[attr-defined]


# -- the message and the approval, checked before anything runs ------------------


def test_a_forged_header_is_a_dead_letter_before_anything_runs() -> None:
    # The worker's main process found it in the message's headers (worker/handoff.py).
    forged = request(forged=("tooleffect_effect",))
    tool = FakeTool(body(), WRITE)
    with pytest.raises(DeadLettered) as ended:
        run(tool, req=forged)
    assert ended.value.dead_letter_reason == "malformed_message"
    assert ended.value.error is None  # the package's refusal is the result
    assert letter_of(ended.value).attempts == 0
    assert tool.run.calls == []  # type: ignore[attr-defined]
    assert tool.runtime.journal.begins == [] and tool.runtime.journal.moves == []
    assert ended.value.pending_letter.journalled is False


def test_a_forged_header_on_an_interactive_call_is_raised() -> None:
    with pytest.raises(EffectRelabelRefused, match="tooleffect_effect"):
        run(FakeTool(body(), WRITE), req=request(interactive=True,
                                               headers={"tooleffect_effect": "x"}))


def test_the_headers_a_producer_may_set_pass() -> None:
    allowed = request(headers={"tooleffect_run_id": "r1", "tooleffect_call_id": "c",
                               "x-custom": 1})
    assert run(FakeTool(body("ok")), req=allowed) == "ok"


def test_arguments_the_body_cannot_take_are_a_dead_letter_showing_the_type_error() -> None:
    tool = FakeTool(body(), WRITE)
    with pytest.raises(DeadLettered) as ended:
        run(tool, "a", "b", "c")
    assert ended.value.dead_letter_reason == "malformed_message"
    assert isinstance(ended.value.error, TypeError)
    assert "tools.t: invalid arguments" in str(ended.value.error)
    with pytest.raises(TypeError, match="invalid arguments"):
        run(tool, nope=1, req=request(interactive=True))
    assert tool.run.calls == []  # type: ignore[attr-defined]


def test_a_call_that_needs_approval_runs_only_when_approved() -> None:
    runtime = FakeRuntime()
    tool = FakeTool(body("ok"), WRITE, runtime=runtime, approval=True)
    # Queued: the worker's main process let it through.
    assert run(tool, req=request(approved=True)) == "ok"
    with pytest.raises(ApprovalRequired):
        run(tool)
    # Interactive: asked of the store, and refused unless approved.
    for state in (ApprovalState.ABSENT, ApprovalState.PENDING, ApprovalState.REJECTED):
        runtime.approvals.answer = state
        with pytest.raises(ApprovalRequired, match=state.value):
            run(tool, req=request(interactive=True, approved=True))
    runtime.approvals.answer = ApprovalState.APPROVED
    assert run(tool, req=request(interactive=True)) == "ok"


# -- a write: the intent, the body, the outcome ----------------------------------------


def test_a_write_records_its_intent_runs_its_body_and_records_its_success() -> None:
    intent = object()
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[started(intent_event=intent)]))
    tool = FakeTool(body("charged"), WRITE, runtime=runtime)
    req = request()
    assert run(tool, "k", req=req) == "charged"
    begin = runtime.journal.begins[0]
    assert begin["effect"] == "non_idempotent_write"
    assert begin["attempts_allowed"] == 3 and begin["resume_interrupted"] is False
    assert begin["call_digest"] == call_digest(("k",), {})
    assert begin["event"].phase == "intent"
    (move,) = runtime.journal.moves
    assert move["new_state"] is JournalState.SUCCEEDED
    assert move["allowed"] == states.SUCCEED_FROM
    assert move["token"] == begin["token"] and move["token"]
    assert move["earlier_copy"] is intent  # the intent's copy rides with the outcome
    assert move["token"] == req.tooleffect_handoff.token  # the main process's token
    assert attempt_notes(req).fencing_token == 7  # what the body reads as fencing_token


@pytest.mark.parametrize("answer", [Verdict.DONE, Verdict.DEAD_LETTERED, Verdict.NOT_RUN])
def test_a_write_that_ended_before_is_acknowledged_without_running(answer: Verdict) -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(answer)]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(Ignore):
        run(tool)
    assert tool.run.calls == [] and runtime.journal.moves == []  # type: ignore[attr-defined]


def test_an_interactive_call_that_ended_before_answers_with_its_kept_result() -> None:
    value = {"id": 3, "items": ["a", "é"]}
    runtime = FakeRuntime()
    tool = FakeTool(body(value), WRITE, runtime=runtime)
    assert run(tool, req=request(interactive=True)) == value
    kept = runtime.journal.moves[0]["fields"]
    assert kept["result_type"] == "application/json utf-8"
    runtime.journal.verdicts = [verdict(Verdict.DONE, kept_result=kept["result"].encode(),
                                        kept_content_type=kept["result_type"])]
    assert run(tool, req=request(interactive=True)) == value
    assert len(tool.run.calls) == 1  # type: ignore[attr-defined]


def test_a_write_owned_by_a_live_worker_comes_back_when_its_lease_ends() -> None:
    lease_end = time.time() + 20
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[
        verdict(Verdict.OWNED, detail=str(lease_end))]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(Ignore):
        run(tool)
    (published,) = tool.published
    assert 19 <= published["countdown"] <= 21.5
    assert runtime.audit.phases() == [("deferred", "owned_elsewhere")]
    # A countdown past the visibility timeout would be restored while it waits.
    runtime.journal.verdicts = [verdict(Verdict.OWNED, detail=str(time.time() + 3600))]
    with pytest.raises(Ignore):
        run(tool)
    assert tool.published[-1]["countdown"] == 0.8 * SETTINGS.visibility_timeout
    assert tool.run.calls == []  # type: ignore[attr-defined]


def test_on_rabbitmq_an_owned_write_comes_back_well_before_consumer_timeout() -> None:
    runtime = FakeRuntime(settings=RABBITMQ_SETTINGS, journal=FakeJournal(verdicts=[
        verdict(Verdict.OWNED, detail=str(time.time() + 3600))]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(Ignore):
        run(tool)
    assert tool.published[-1]["countdown"] == 0.25 * 100


def test_an_owned_write_called_interactively_or_not_republished() -> None:
    owned = verdict(Verdict.OWNED, detail=str(time.time() + 5))
    tool = FakeTool(body(), WRITE, runtime=FakeRuntime(journal=FakeJournal(verdicts=[owned])))
    with pytest.raises(AttemptInProgress):
        run(tool, req=request(interactive=True))
    tool.publish_fails = True
    with pytest.raises(Reject) as kept:
        run(tool)
    assert kept.value.requeue is True


@pytest.mark.parametrize(("detail", "said"), [("tool", "belongs to a call of tools.other"),
                                              ("arguments", "with other arguments")])
def test_a_task_id_of_another_call_is_a_conflict_letter_of_its_own(detail: str,
                                                                     said: str) -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[
        verdict(Verdict.CONFLICT, detail=detail, recorded_tool="tools.other")]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool, "k")
    assert ended.value.dead_letter_reason == "call_id_conflict"
    # The task id's result is the first call's.
    assert ended.value.pending_letter.keep_result is True
    letter = letter_of(ended.value)
    assert letter.task_id == conflict_letter_id(TASK_ID, call_digest(("k",), {}))
    assert said in letter.error
    assert runtime.journal.moves == []  # the first call's entry is untouched
    with pytest.raises(CallIdConflict, match=said):
        run(tool, "k", req=request(interactive=True))


def test_a_write_whose_budget_was_spent_earlier_is_a_dead_letter_saying_how() -> None:
    endings = {Ending.FAILED: 1, Ending.INTERRUPTED: 2, Ending.REQUESTED: 0}
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[
        verdict(Verdict.EXHAUSTED, attempt=3, endings=endings)]))
    tool = FakeTool(body(), IDEMPOTENT, runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert ended.value.dead_letter_reason == "retries_exhausted"
    error = letter_of(ended.value).error
    assert "retry budget of 2 is spent after 3 attempt(s)" in error
    assert "1 failed with a retryable error" in error and "2 interrupted" in error
    assert "asked for" not in error
    (move,) = runtime.journal.moves
    # Not its attempt: it may not move a running entry (no owner token).
    assert (move["new_state"], move["allowed"], move["token"]) == (
        JournalState.DEAD_LETTERING, states.DEAD_LETTER_UNOWNED_FROM, "")
    assert tool.run.calls == []  # type: ignore[attr-defined]


def test_an_interrupted_write_without_reconcile_is_never_run_again() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[
        verdict(Verdict.INTERRUPTED, attempt=2, detail="started")]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert ended.value.dead_letter_reason == "interrupted_write"
    assert "recorded its intent and never its outcome" in letter_of(ended.value).error
    assert letter_of(ended.value).attempts == 2
    assert tool.run.calls == []  # type: ignore[attr-defined]
    runtime.journal.verdicts = [verdict(Verdict.INTERRUPTED, detail="failed")]
    with pytest.raises(DeadLettered) as raised:
        run(tool)
    assert "raised in an earlier call and may have written" in letter_of(raised.value).error


def test_reconcile_applied_settles_the_write_without_running_it() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.INTERRUPTED)]))
    tool = FakeTool(body(), WRITE, runtime=runtime,
                    reconcile=lambda key="k": Reconciliation.applied("ch-1", evidence="found"))
    assert run(tool) == "ch-1"
    (move,) = runtime.journal.moves
    assert (move["new_state"], move["allowed"], move["token"]) == (
        JournalState.SUCCEEDED, states.RECONCILED_FROM, "")
    assert runtime.audit.phases() == [("reconcile", "applied")]
    assert tool.run.calls == []  # type: ignore[attr-defined]


def test_reconcile_not_applied_begins_a_new_attempt_that_runs_the_body() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.INTERRUPTED),
                                                        started(2)]))
    tool = FakeTool(body("again"), WRITE, runtime=runtime,
                    reconcile=lambda key="k": Reconciliation.not_applied(evidence="none"))
    assert run(tool) == "again"
    assert [begin["resume_interrupted"] for begin in runtime.journal.begins] == [False, True]
    assert len(tool.run.calls) == 1  # type: ignore[attr-defined]


def _slow(key: str = "k") -> Reconciliation:
    time.sleep(1.0)
    return Reconciliation.applied("late")


def _raising(key: str = "k") -> Reconciliation:
    raise LookupError("search down")


@pytest.mark.parametrize(("check", "said"), [
    (lambda key="k": Reconciliation.unknown(evidence="no record"),
     "its reconcile answered unknown (no record)"),
    (_raising, "its reconcile failed: LookupError: search down"),
    (lambda key="k": "yes", "its reconcile failed: ReconcileFailed: reconcile answered str"),
    (_slow, "its reconcile failed: ReconcileFailed: reconcile did not answer within 0.2s"),
])
def test_reconcile_that_does_not_know_leaves_an_interrupted_write_dead_lettered(
        check: Callable[..., Any], said: str) -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.INTERRUPTED)]))
    tool = FakeTool(body(), WRITE, runtime=runtime, reconcile=check)
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert ended.value.dead_letter_reason == "interrupted_write"
    assert said in letter_of(ended.value).error
    assert tool.run.calls == []  # type: ignore[attr-defined]


def test_a_reconciled_success_that_cannot_be_recorded_is_retried_unrun() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.INTERRUPTED)],
                                              moved=[StoreUnavailable("down")]))
    tool = FakeTool(body(), WRITE, runtime=runtime,
                    reconcile=lambda key="k": Reconciliation.applied("x"))
    with pytest.raises(Retry) as ended:
        run(tool)
    assert isinstance(ended.value.exc, IntentNotRecorded)
    runtime.journal.moved = [False]  # another delivery settled it meanwhile
    with pytest.raises(LeaseLost):
        run(tool)


# -- a result the result backend cannot encode ------------------------------------------

#: A result backend that stores with JSON (Celery's cache backend, in memory).
JSON_BACKEND = app_with(result_backend="cache+memory://", result_serializer="json").backend


def storing(tool: FakeTool) -> FakeTool:
    """``tool`` with its result stored by Celery's backend (not ignored)."""
    tool.ignore_result = False
    tool.backend = JSON_BACKEND  # type: ignore[attr-defined]
    return tool


@pytest.mark.parametrize("effect", [READ, IDEMPOTENT, WRITE], ids=lambda effect: effect.value)
def test_a_result_the_backend_cannot_encode_ends_the_call_once_as_having_run(
        effect: ToolEffect) -> None:
    intent = object()
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[started(intent_event=intent)]))
    tool = storing(FakeTool(body({"a"}), effect, runtime=runtime))
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert tool.run.calls == [("k",)]  # type: ignore[attr-defined]
    assert (ended.value.dead_letter_reason, ended.value.failure_class) == (
        "not_retryable", "unknown")
    shown = ended.value.error  # Celery's result: the package's EncodeError
    assert isinstance(shown, ResultNotStorable) and isinstance(shown, EncodeError)
    assert shown.result_type == "set"
    assert "the result serializer 'json' cannot encode a set: EncodeError: Object of type " \
           "set is not JSON serializable" in str(shown)
    letter = letter_of(ended.value)
    assert (letter.exception_type, letter.body_completed, letter.attempts) == (
        "ResultNotStorable", effect.is_write, 1)
    if effect.is_write:
        # Recorded as having run: dead-lettering from the owner's running attempt,
        # never a success, never interrupted; the intent's global copy goes alone.
        (move,) = runtime.journal.moves
        assert (move["new_state"], move["allowed"], move["fields"]["body_completed"]) == (
            JournalState.DEAD_LETTERING, states.DEAD_LETTER_FROM, "1")
        assert move["token"] == runtime.journal.begins[0]["token"]
        assert move["event"].status == "result_not_stored"
        assert runtime.audit.copies == [intent]
    else:
        assert runtime.journal.moves == []
        assert runtime.audit.phases() == [("outcome", "result_not_stored")]


def test_a_result_that_can_be_encoded_or_is_not_stored_succeeds() -> None:
    assert run(storing(FakeTool(body(["a"]), WRITE))) == ["a"]
    assert run(FakeTool(body({"a"}), WRITE)) == {"a"}  # ignore_result: nothing to encode
    interactive = storing(FakeTool(body({"a"}), WRITE))
    assert run(interactive, req=request(interactive=True)) == {"a"}  # answers its caller


def test_a_reconciled_result_the_backend_cannot_encode_is_a_dead_letter_of_a_write_that_ran(
) -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.INTERRUPTED)]))
    tool = storing(FakeTool(body(), WRITE, runtime=runtime,
                            reconcile=lambda key="k": Reconciliation.applied({"ch-1"})))
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert tool.run.calls == []  # type: ignore[attr-defined]
    assert "was reconciled as applied, but its result cannot be stored" in str(
        ended.value.error)
    assert letter_of(ended.value).body_completed
    (move,) = runtime.journal.moves  # no success recorded: a dead letter, unowned
    assert (move["new_state"], move["allowed"], move["token"]) == (
        JournalState.DEAD_LETTERING, states.DEAD_LETTER_UNOWNED_FROM, "")


def test_a_dead_letter_begun_earlier_is_finished_with_its_recorded_reason() -> None:
    entry = {"reason": "interrupted_write", "failure_class": "unknown",
             "exception_type": "InterruptedWrite", "body_completed": "1"}
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.DEAD_LETTERING)],
                                              entry=entry))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert ended.value.dead_letter_reason == "interrupted_write"
    assert letter_of(ended.value).body_completed is True
    assert runtime.journal.moves[0]["allowed"] == states.FINISH_DEAD_LETTER_FROM
    runtime.journal.entry = {"reason": "no such reason"}
    with pytest.raises(DeadLettered) as unknown:
        run(tool)
    assert unknown.value.dead_letter_reason == "not_retryable"


def test_a_lease_lost_with_the_intent_forgets_the_delivery() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.LEASE_LOST)]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(LeaseLost):
        run(tool)
    assert runtime.audit.phases() == [("lease_refused", "lost")]


def test_a_lease_kept_busy_is_asked_again_then_retried_unrun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Leases, "BUSY_WAIT", 0.0)
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[verdict(Verdict.LEASE_BUSY)]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(Retry):
        run(tool)
    assert len(runtime.journal.begins) == Leases.BUSY_RETRIES
    assert runtime.journal.moves == []  # nothing was recorded: nothing to settle
    # Busy a few times only: it begins.
    runtime.journal.verdicts = [verdict(Verdict.LEASE_BUSY), verdict(Verdict.LEASE_BUSY),
                                started()]
    runtime.journal.begins.clear()
    assert run(tool) == "done"
    assert len(runtime.journal.begins) == 3


def test_a_journal_that_cannot_record_the_intent_retries_the_call_unrun() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[StoreUnavailable("down")]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(Retry) as ended:
        run(tool)
    assert isinstance(ended.value.exc, IntentNotRecorded)
    assert runtime.journal.moves == [] and tool.run.calls == []  # type: ignore[attr-defined]
    with pytest.raises(IntentNotRecorded):
        run(tool, req=request(interactive=True))


@pytest.mark.parametrize(("entry", "letters"), [
    ({"state": "succeeded"}, False), ({"state": "dead_lettered"}, False),
    ({}, True),
])
def test_a_store_that_refuses_writes_still_acknowledges_a_call_that_ended(
        entry: dict[str, str], letters: bool) -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[StoreUnavailable("OOM")], entry=entry),
                          dead_letters=FakeDeadLetters(exists_answer=letters))
    with pytest.raises(Ignore):
        run(FakeTool(body(), WRITE, runtime=runtime))


def test_a_store_that_answers_nothing_is_not_taken_for_an_ended_call() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[StoreUnavailable("down")],
                                              entry=StoreUnavailable("down")),
                          dead_letters=FakeDeadLetters(exists_answer=StoreUnavailable("down")))
    with pytest.raises(Retry):
        run(FakeTool(body(), WRITE, runtime=runtime))


def test_an_intent_that_is_not_durable_is_settled_as_a_failure_before_the_body() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[IntentNotDurable("WAIT 0/1", 1)]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(Retry) as ended:
        run(tool)
    assert isinstance(ended.value.exc, IntentNotDurable)
    (move,) = runtime.journal.moves
    assert (move["new_state"], move["ending"]) == (JournalState.RETRY_SCHEDULED, Ending.FAILED)
    assert move["allowed"] == states.SETTLE_FROM
    assert tool.run.calls == []  # type: ignore[attr-defined]


# -- a write's failures -------------------------------------------------------------


def test_a_failed_idempotent_write_is_settled_then_retried() -> None:
    intent = object()
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[started(intent_event=intent)]))
    tool = FakeTool(failing(ConnectionError("down")), IDEMPOTENT, runtime=runtime)
    with pytest.raises(Retry) as ended:
        run(tool)
    assert ended.value.when == 1.0
    (move,) = runtime.journal.moves
    assert (move["new_state"], move["ending"], move["allowed"]) == (
        JournalState.RETRY_SCHEDULED, Ending.FAILED, states.SETTLE_FROM)
    assert (move["event"].status, move["event"].details["countdown"]) == ("retrying", "1")
    assert runtime.audit.copies == [intent]  # the intent's copy goes alone on a failure


def test_a_non_idempotent_write_that_failed_after_its_body_started_is_never_retried() -> None:
    runtime = FakeRuntime()
    tool = FakeTool(failing(ConnectionError("timeout after the charge?")), WRITE,
                    runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert ended.value.dead_letter_reason == "not_retryable"
    assert ended.value.failure_class == "connection"
    (move,) = runtime.journal.moves
    # Its own attempt: fenced by its owner token, from running too.
    assert (move["new_state"], move["allowed"]) == (JournalState.DEAD_LETTERING,
                                                    states.DEAD_LETTER_FROM)
    assert move["token"] == runtime.journal.begins[0]["token"]
    assert move["fields"]["reason"] == "not_retryable"
    assert tool.published == []


def test_a_non_idempotent_write_that_says_it_wrote_nothing_is_retried() -> None:
    runtime = FakeRuntime()
    tool = FakeTool(failing(NoSideEffect(ConnectionError("refused before sending"))), WRITE,
                    runtime=runtime)
    with pytest.raises(Retry):
        run(tool)
    assert runtime.journal.states_moved_to() == [JournalState.RETRY_SCHEDULED]


def test_a_write_past_its_budget_is_a_dead_letter() -> None:
    runtime = FakeRuntime(journal=FakeJournal(verdicts=[started(3)]))
    tool = FakeTool(failing(ConnectionError("down")), IDEMPOTENT, runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool, req=request(retries=2))
    assert ended.value.dead_letter_reason == "retries_exhausted"
    assert letter_of(ended.value).attempts == 3


def test_a_failure_whose_settling_cannot_be_stored_is_a_dead_letter() -> None:
    runtime = FakeRuntime(journal=FakeJournal(moved=[StoreUnavailable("down"), True]))
    tool = FakeTool(failing(ConnectionError("down")), IDEMPOTENT, runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    assert ended.value.dead_letter_reason == "not_retryable"
    assert letter_of(ended.value).exception_type == "AuditPersistenceFailed"
    assert runtime.journal.states_moved_to() == [JournalState.RETRY_SCHEDULED,
                                                 JournalState.DEAD_LETTERING]


def test_a_failure_settled_by_a_worker_that_lost_its_lease_is_forgotten() -> None:
    runtime = FakeRuntime(journal=FakeJournal(moved=[False]))
    with pytest.raises(LeaseLost):
        run(FakeTool(failing(ConnectionError("down")), IDEMPOTENT, runtime=runtime))


def test_a_retry_the_write_asks_for_is_settled_as_requested() -> None:
    runtime = FakeRuntime()
    tool = FakeTool(failing(Retry(exc=ValueError("x"), when=3)), WRITE, runtime=runtime)
    with pytest.raises(Retry):
        run(tool)
    (move,) = runtime.journal.moves
    assert (move["new_state"], move["ending"]) == (JournalState.RETRY_SCHEDULED,
                                                   Ending.REQUESTED)
    assert move["fields"] is None  # the same arguments: the same call


def test_an_interactive_write_that_failed_is_settled_failed_saying_whether_it_wrote() -> None:
    for failure, wrote in ((ValueError("x"), "0"), (NoSideEffect("refused"), "1")):
        runtime = FakeRuntime()
        with pytest.raises(type(failure)):
            run(FakeTool(failing(failure), WRITE, runtime=runtime),
                req=request(interactive=True))
        (move,) = runtime.journal.moves
        assert move["new_state"] is JournalState.FAILED
        assert move["fields"] == {"no_side_effect": wrote}


def test_an_outcome_that_cannot_be_recorded_fails_closed() -> None:
    runtime = FakeRuntime(journal=FakeJournal(moved=[StoreUnavailable("down")]))
    tool = FakeTool(body(), WRITE, runtime=runtime)
    with pytest.raises(DeadLettered) as ended:
        run(tool)
    letter = letter_of(ended.value)
    assert (letter.reason, letter.exception_type, letter.failure_class, letter.body_completed) == (
        "not_retryable", "AuditPersistenceFailed", "unknown", True)
    # The dead letter's own move failed too: the letter says the outcome is lost.
    assert "could not be recorded" in letter.error
    with pytest.raises(AuditPersistenceFailed) as interactive:
        run(tool, req=request(interactive=True))
    assert interactive.value.body_completed is True


def test_an_outcome_after_the_lease_was_lost_is_a_late_outcome() -> None:
    runtime = FakeRuntime(journal=FakeJournal(moved=[False]))
    tool = FakeTool(body("r"), WRITE, runtime=runtime)
    with pytest.raises(LeaseLost):
        run(tool)
    (late,) = runtime.dead_letters.late
    assert late[0] == TASK_ID and late[1].status == "succeeded"
    # Interactive: the caller has its answer all the same.
    assert run(tool, req=request(interactive=True)) == "r"


# -- a deadline: the broker lease secured before anything is recorded ---------------


def test_a_deadline_secures_the_broker_lease_before_the_intent() -> None:
    runtime = FakeRuntime(leases=FakeLeases(lease=object()))
    before = time.time()
    assert run(FakeTool(body("ok"), WRITE, runtime=runtime, deadline=30)) == "ok"
    (until,) = runtime.leases.extended
    assert before + 30 <= until <= time.time() + 30
    assert runtime.journal.begins[0]["broker_lease"] is None


def test_a_broker_lease_on_the_store_s_redis_rides_with_the_intent() -> None:
    lease = object()
    runtime = FakeRuntime(leases=FakeLeases(lease=lease, reaches_the_broker=True))
    assert run(FakeTool(body("ok"), WRITE, runtime=runtime, deadline=30)) == "ok"
    assert runtime.leases.extended == []
    assert runtime.journal.begins[0]["broker_lease"] is lease


@pytest.mark.parametrize(("refused", "ending"), [(LeaseVerdict.LOST, LeaseLost),
                                                 (LeaseVerdict.BUSY, Retry)])
def test_a_broker_lease_that_cannot_be_secured_runs_nothing(
        refused: LeaseVerdict, ending: type[BaseException]) -> None:
    runtime = FakeRuntime(leases=FakeLeases(lease=object(), verdict=refused))
    tool = FakeTool(body(), WRITE, runtime=runtime, deadline=30)
    with pytest.raises(ending):
        run(tool)
    assert runtime.journal.begins == [] and tool.run.calls == []  # type: ignore[attr-defined]
    assert runtime.audit.phases() == [("lease_refused", refused.value)]


def test_an_interactive_call_secures_no_broker_lease() -> None:
    runtime = FakeRuntime(leases=FakeLeases(lease=object(), verdict=LeaseVerdict.LOST))
    assert run(FakeTool(body("ok"), WRITE, runtime=runtime, deadline=30),
               req=request(interactive=True)) == "ok"


def test_every_attempt_of_a_delivery_gets_its_own_owner_token() -> None:
    runtime = FakeRuntime()
    tool = FakeTool(body(), WRITE, runtime=runtime)
    for _ in range(3):
        run(tool, req=request(id=str(uuid.uuid4())))
    tokens = [begin["token"] for begin in runtime.journal.begins]
    assert len(set(tokens)) == 3 and all(tokens)
