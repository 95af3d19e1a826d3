"""An agent's tool call, from its arguments to what the model is told.

:class:`ToolCaller` is what every agent integration shares (the MCP server and
each SDK adapter): it validates the arguments with the tool's
:class:`~celery_tooleffect.agents.schema.ToolSpec`, publishes the task with
the agent's call id and run id as its identity (``apply_async(call_id=,
run_id=)``: a resend is the same call, acknowledged without running once it
ended), waits for it without blocking the event loop, and answers with a
:class:`CallReport`: how the call stands (:class:`~celery_tooleffect.states.CallStatus`)
and, once it ended, its result, or the failure class, dead-letter reason and
task id of its error.

Waiting uses Celery's own ``AsyncResult.get()`` (on a Redis result backend it
wakes on the result's PUBLISH), one tick at a time in a worker thread, so that
a call that is still queued, running or parked can be reported while it waits.
A call parked for approval is answered after ``approval_wait`` seconds with
AWAITING_APPROVAL (not an error); the agent asks :meth:`ToolCaller.status`
later. A caller that goes away (a client that disconnects, a cancelled agent
run) leaves the call running: it is in Celery's hands, and its status says
how it ended.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Coroutine, Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .extras import ANY_AGENT_EXTRA, missing_extra

try:
    import anyio
    import anyio.from_thread
    import anyio.to_thread
except ModuleNotFoundError as exc:  # no agent extra installed
    raise missing_extra(exc, __name__, ANY_AGENT_EXTRA) from exc
from celery import states as celery_states
from celery.exceptions import TimeoutError as ResultTimeout
from kombu.exceptions import OperationalError

from ..errors import (
    ApprovalRejected,
    CallIdConflict,
    DeadLettered,
    InvalidCallId,
    InvalidToolArguments,
    StoreUnavailable,
)
from ..identity import CALLER_HEADER, MAX_CALLER_LENGTH
from ..states import ApprovalState, CallStatus, JournalState
from ..store.journal import JournalRef
from ..store.runtime import runtime_for
from ..task import ToolTask
from .schema import MAX_ARGUMENT_BYTES, ToolSpec

if TYPE_CHECKING:
    from celery import Celery

#: The name of the status tool an agent asks about a call it was told to ask
#: about later (awaiting approval, still running, a disconnected client).
STATUS_TOOL = "tooleffect_call_status"

#: How long a FAILURE waits for its dead letter: the worker's main process
#: stores it right after the pool stored the result (``docs/guide.md``,
#: "What a failed call's result holds").
LETTER_WAIT = 5.0

#: The largest result text the model receives by default
#: (``tooleffect_agent_max_result_bytes``), in UTF-8 bytes.
MAX_RESULT_BYTES = 32 * 1024

Progress = Callable[["CallReport"], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class CallReport:
    """How a call stands, and what the model is told about it."""

    task_id: str
    tool: str
    status: CallStatus
    run_id: str = ""
    #: The agent's id of the call (its tool-call id or idempotency key), if any.
    call_id: str = ""
    #: The tool's result (SUCCEEDED only).
    result: Any = None
    #: The error's type and text (every error status).
    error_type: str = ""
    error: str = ""
    #: The failure class and dead-letter reason (DEAD_LETTERED; FAILED: the class).
    failure_class: str = ""
    dead_letter_reason: str = ""
    #: DEAD_LETTERED: the body ran to its end (its result or outcome could not
    #: be kept), so any effect of it took place.
    body_completed: bool = False
    #: For invalid arguments: each field that does not fit, and why.
    invalid: tuple[dict[str, Any], ...] = field(default=())
    #: AWAITING_APPROVAL: who approves it (an Approver value: operator, user,
    #: both; '' when not known) and where its approval stands (pending, or
    #: user_approved: its user approved, an operator has not yet).
    approver: str = ""
    approval_state: str = ""
    #: The largest text the model is given (the result, or what happened);
    #: a longer one is cut, with a note naming the task id that holds it whole.
    max_result_bytes: int = field(default=MAX_RESULT_BYTES, compare=False, repr=False)

    @cached_property
    def result_text(self) -> str:
        """The whole result as text (SUCCEEDED): a string as is, else JSON."""
        if self.status is not CallStatus.SUCCEEDED:
            return ""
        return self.result if isinstance(self.result, str) else _json(self.result)

    @property
    def result_cut(self) -> bool:
        """True when the result is longer than the model is given: it is then
        told the first :attr:`max_result_bytes` and a note, never the whole."""
        return _size(self.result_text) > self.max_result_bytes

    @property
    def is_error(self) -> bool:
        """True when the model must be told the call failed."""
        return self.status.is_error

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the ``structuredContent`` of an error or of a call that
        has not ended, and the status tool's answer."""
        data: dict[str, Any] = {"status": self.status.value, "tool": self.tool,
                                "task_id": self.task_id}
        if self.run_id:
            data["run_id"] = self.run_id
        if self.call_id:
            data["call_id"] = self.call_id
        if self.status is CallStatus.SUCCEEDED:
            if self.result_cut:  # the cut text is the message; the whole stays in Celery
                data["result_truncated"] = True
                data["result_bytes"] = _size(self.result_text)
            else:
                data["result"] = self.result
        for name in ("error_type", "error", "failure_class", "dead_letter_reason"):
            if getattr(self, name):
                data[name] = _clip(getattr(self, name), self.max_result_bytes)
        if self.body_completed:
            data["body_completed"] = True
        if self.invalid:
            data["invalid_arguments"] = list(self.invalid)
        if self.approver:
            data["approver"] = self.approver
        if self.approval_state:
            data["approval_state"] = self.approval_state
        data["message"] = self.message()
        return data

    def message(self) -> str:
        """What the model reads: the result, or what happened and what to do;
        cut to :attr:`max_result_bytes` with a note when longer."""
        told = self.result_text if self.status is CallStatus.SUCCEEDED else self._told()
        size = _size(told)
        if size <= self.max_result_bytes:
            return told
        shown = _clip(told, self.max_result_bytes)
        what = "result" if self.status is CallStatus.SUCCEEDED else "answer"
        return (f"{shown}\n[cut: the {what} is {size} bytes of text; the first "
                f"{_size(shown)} are shown and {size - _size(shown)} cut "
                f"(tooleffect_agent_max_result_bytes). It is kept whole as the result of "
                f"task_id {self.task_id} in Celery's result backend "
                f"(AsyncResult('{self.task_id}').result), for the app or an operator to "
                f"read; calling {self.tool or 'the tool'} again shows no more.]")

    def _told(self) -> str:
        status, tool, task = self.status, self.tool, self.task_id
        if status is CallStatus.UNKNOWN:
            return (f"No call of the tools served here has task_id {task}: it is another "
                    "task's, or nobody published it, or its record expired. Nothing is "
                    "known of it here.")
        if status is CallStatus.AWAITING_APPROVAL:
            return f"{self._awaiting()} Do not call it again: ask {STATUS_TOOL} with task_id " \
                   f"{task} later."
        if status in (CallStatus.QUEUED, CallStatus.RUNNING):
            return (f"{tool} is {status.value} and has not ended yet. Do not call it again: "
                    f"ask {STATUS_TOOL} with task_id {task} later.")
        if status is CallStatus.REFUSED:
            error = self.error.removeprefix(f"{tool}: ")
            return f"{tool} was not called: {error}"
        if status is CallStatus.REJECTED:
            why = self.error.removesuffix("; nothing ran")
            return (f"{tool} was rejected: a person did not approve it ({why}). "
                    f"Nothing of it ran (task_id {task}).")
        if status is CallStatus.REVOKED:
            return f"{tool} was cancelled by an operator (task_id {task})."
        said = f"{self.error_type}: {self.error}" if self.error_type else self.error
        if status is CallStatus.DEAD_LETTERED:
            after = (" It ran to its end: whatever it does was done; do not call it again."
                     if self.body_completed else
                     " It may or may not have taken effect; do not call it again."
                     if self.dead_letter_reason in ("interrupted_write", "revoked") else
                     " It will not be retried; do not call it again with the same arguments.")
            return (f"{tool} failed ({self.failure_class}) and was dead-lettered "
                    f"({self.dead_letter_reason}): {said}.{after} An operator can inspect "
                    f"task_id {task}.")
        return f"{tool} failed ({self.failure_class or 'error'}): {said} (task_id {task})."


    def _awaiting(self) -> str:
        """Who the call waits for, and who can decide it from where."""
        tool, task = self.tool, self.task_id
        approve = f"`celery tooleffect approvals approve {task}`"
        if self.approver == "both" and self.approval_state == ApprovalState.USER_APPROVED.value:
            return (f"{tool} was approved by its user and is waiting for an operator's "
                    f"approval ({approve}); nothing of it has run.")
        if self.approver not in ("user", "both"):
            return f"{tool} is waiting for a person's approval; nothing of it has run."
        # Its user's approval was not asked for: a client that asks its user
        # (MCP elicitation, an SDK's pause) records it before the call is published.
        unasked = ("the client that made this call did not ask its user (an MCP client "
                   "without elicitation cannot)")
        if self.approver == "user":
            return (f"{tool} is waiting for its user's approval, and {unasked}; nothing of it "
                    f"has run. An operator can approve it instead: {approve}.")
        return (f"{tool} is waiting for its user's approval, then an operator's, and "
                f"{unasked}; nothing of it has run. An operator cannot approve it before its "
                "user does: it runs once its user approves it through a client that asks "
                f"them, then an operator (an operator can reject it: `celery tooleffect "
                f"approvals reject {task}`).")


class ToolCaller:
    """Calls ``app``'s tools for an agent: validate, publish, wait, report.

    ``approval_wait``: seconds a call parked for approval is waited for before
    the answer is AWAITING_APPROVAL; ``result_wait``: seconds any other call
    is waited for before the answer is its status (QUEUED or RUNNING), never
    an error; ``tick``: how often a waiting call's status is read (and
    reported as progress); ``max_argument_bytes``: the largest arguments a
    call takes; ``max_result_bytes``: the largest text the model is given.
    """

    def __init__(self, app: Celery, *, approval_wait: float = 30.0,
                 result_wait: float = 300.0, tick: float = 1.0,
                 max_argument_bytes: int = MAX_ARGUMENT_BYTES,
                 max_result_bytes: int = MAX_RESULT_BYTES,
                 waiting_threads: int = 100) -> None:
        self.app = app
        self.approval_wait = approval_wait
        self.result_wait = result_wait
        self.tick = tick
        self.max_argument_bytes = max_argument_bytes
        self.max_result_bytes = max_result_bytes
        self.waiting_threads = waiting_threads
        self._specs: dict[str, ToolSpec] = {}
        self._limiter: anyio.CapacityLimiter | None = None

    @classmethod
    def for_app(cls, app: Celery) -> ToolCaller:
        """The app's caller, with the waits and limits of its settings
        (``tooleffect_agent_*``): one per app, shared by the adapters."""
        caller = _callers.get(app)
        if caller is None:
            settings = runtime_for(app).settings
            caller = cls(app, approval_wait=settings.agent_approval_wait,
                         result_wait=settings.agent_result_wait,
                         max_argument_bytes=settings.agent_max_argument_bytes,
                         max_result_bytes=settings.agent_max_result_bytes)
            _callers[app] = caller
        return caller

    # -- the tools ------------------------------------------------------------

    def tools(self, patterns: Iterable[str] = ()) -> list[ToolTask]:
        """The app's tools (every ToolTask but Celery's own), by name, those
        whose name matches one of ``patterns`` (``fnmatch``) if any are given."""
        self.app.loader.import_default_modules()
        self.app.finalize(auto=True)
        wanted = list(patterns)
        return sorted(
            (task for name, task in self.app.tasks.items()
             if isinstance(task, ToolTask) and not task._tooleffect_plain
             and (not wanted or any(fnmatch.fnmatchcase(name, p) for p in wanted))),
            key=lambda task: str(task.name),
        )

    def spec(self, tool: ToolTask | str) -> ToolSpec:
        """The tool's :class:`ToolSpec` (built once; ``ToolSchemaError`` if it
        cannot be described, ``KeyError`` for a name that is no tool)."""
        name = tool if isinstance(tool, str) else str(tool.name)
        spec = self._specs.get(name)
        if spec is None:
            task = self.app.tasks[name] if isinstance(tool, str) else tool
            if not isinstance(task, ToolTask) or task._tooleffect_plain:
                raise KeyError(f"{name} is no tool")
            spec = ToolSpec.of(task, max_argument_bytes=self.max_argument_bytes)
            self._specs[name] = spec
        return spec

    # -- calling --------------------------------------------------------------

    async def call(self, tool: ToolTask | str, arguments: Any, *, call_id: str | None = None,
                   run_id: str | None = None, progress: Progress | None = None,
                   published: Callable[[str], None] | None = None,
                   caller: str | None = None, result_wait: float | None = None,
                   ) -> CallReport:
        """Call ``tool`` with an agent's ``arguments`` (a mapping or its JSON)
        and wait for it, reporting each change of status to ``progress``;
        ``published`` is given the task id as soon as the call is published
        (also when the caller was cancelled while it was being published);
        ``result_wait`` bounds the wait (default the caller's, :meth:`wait`).
        ``call_id`` (the agent's tool-call id or an idempotency key) and
        ``run_id`` make the call's task id: the same pair is the same call.
        ``caller`` names who made it (the ``tooleffect_caller`` header, which
        its audit events record). Invalid arguments, an id that is another
        call's, or a broker that refuses the message answer REFUSED: nothing
        was published."""
        submitted = await self.submit(tool, arguments, call_id=call_id, run_id=run_id,
                                      published=published, caller=caller)
        if submitted.status is CallStatus.REFUSED:
            return submitted
        return await self.wait(submitted.task_id, tool=submitted.tool, run_id=run_id or "",
                               call_id=call_id or "", progress=progress, result_wait=result_wait)

    async def submit(self, tool: ToolTask | str, arguments: Any, *, call_id: str | None = None,
                     run_id: str | None = None,
                     published: Callable[[str], None] | None = None,
                     caller: str | None = None) -> CallReport:
        """:meth:`call` without the wait: QUEUED with the task id once the
        call is published, or REFUSED when nothing was."""
        spec = self.spec(tool)
        name = spec.name
        try:
            kwargs = spec.validate(arguments)
        except InvalidToolArguments as exc:
            return CallReport("", name, CallStatus.REFUSED, run_id or "", call_id or "",
                              error_type="InvalidToolArguments", error=str(exc),
                              failure_class="client_error", invalid=tuple(exc.errors))
        try:
            # Not abandoned on cancel: a message that left is known by its id.
            task_id = await anyio.to_thread.run_sync(self.publish, name, kwargs, call_id, run_id,
                                                     caller)
            if published is not None:
                published(task_id)
        except (CallIdConflict, InvalidCallId) as exc:
            return CallReport(getattr(exc, "task_id", "") or "", name, CallStatus.REFUSED,
                              run_id or "", call_id or "", error_type=type(exc).__name__,
                              error=str(exc), failure_class="client_error")
        except (StoreUnavailable, OperationalError, OSError) as exc:
            # The claim or the publish did not get through (kombu's own publish
            # retries are spent). Calling again with the same call id is the
            # same call, whether or not the message left.
            again = ("; call again with the same call id" if call_id else
                     "; calling again is a new call")
            return CallReport("", name, CallStatus.REFUSED, run_id or "", call_id or "",
                              error_type=type(exc).__name__,
                              error=f"not published, the broker or store did not answer: "
                                    f"{exc}{again}", failure_class="connection")
        return CallReport(task_id, name, CallStatus.QUEUED, run_id or "", call_id or "",
                          max_result_bytes=self.max_result_bytes)

    def publish(self, tool: str, kwargs: dict[str, Any], call_id: str | None = None,
                run_id: str | None = None, caller: str | None = None) -> str:
        """Publish the call (blocking): its task id. ``CallIdConflict`` or
        ``InvalidCallId`` when its identity cannot be this call's. ``caller``:
        the ``tooleffect_caller`` header (who made the call)."""
        # Without a call id the caller still chooses the task id, so that it is
        # claimed for its tool: the status tool answers only for served tools.
        options: dict[str, Any] = {"task_id": uuid.uuid4().hex} if call_id is None else {
            "call_id": call_id}
        if run_id is not None:
            options["run_id"] = run_id
        if caller:
            options["headers"] = {CALLER_HEADER: caller[:MAX_CALLER_LENGTH]}
        return str(self.app.tasks[tool].apply_async(kwargs=kwargs, **options).id)

    async def wait(self, task_id: str, *, tool: str = "", run_id: str = "", call_id: str = "",
                   progress: Progress | None = None, result_wait: float | None = None,
                   ) -> CallReport:
        """Wait for ``task_id`` until it ends, until ``approval_wait`` passed while
        it is parked, or until ``result_wait`` (default the caller's) passed."""
        stop = threading.Event()
        changes: Callable[[CallReport], None] | None = None
        if progress is not None:
            def changes(report: CallReport) -> None:
                if not stop.is_set():
                    # The caller's loop may have gone away: the call is waited for still.
                    with contextlib.suppress(Exception):
                        anyio.from_thread.run(progress, report)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.waiting_threads)
        try:
            return await anyio.to_thread.run_sync(
                self._wait, task_id, tool, run_id, call_id, changes,
                self.result_wait if result_wait is None else result_wait, stop,
                limiter=self._limiter, abandon_on_cancel=True,
            )
        finally:
            stop.set()

    async def status(self, task_id: str, *, run_id: str = "",
                     tools: Collection[str] | None = None) -> CallReport:
        """How ``task_id`` stands now (the status tool's answer), if it is a
        call of one of ``tools`` (default: any of the app's tools); UNKNOWN
        for any other id, as for one that does not exist."""
        return await anyio.to_thread.run_sync(self.answer_status, task_id, run_id, tools)

    def answer_status(self, task_id: str, run_id: str = "",
                      tools: Collection[str] | None = None) -> CallReport:
        """:meth:`status`, blocking."""
        served = {str(task.name) for task in self.tools()} if tools is None else set(tools)
        tool = self.tool_of(task_id) if task_id else ""
        if tool not in served:
            return CallReport(task_id, "", CallStatus.UNKNOWN,
                              max_result_bytes=self.max_result_bytes)
        return self.observe(task_id, tool, run_id, "", 0.0)

    def tool_of(self, task_id: str) -> str:
        """The tool ``task_id`` is a call of ('' when nothing says): its
        publish-time claim (every call an agent makes, and every call whose
        producer chose its id), else its dead letter, its approval, or its
        Celery result (``result_extended``) names it."""
        runtime = runtime_for(self.app)
        named = runtime.calls.tool(task_id)
        if named:
            return named
        letter = runtime.dead_letters.get(task_id)
        if letter is not None and letter.name:
            return letter.name
        approval = runtime.approvals.get(task_id)
        if approval is not None and approval.name:
            return approval.name
        return str(getattr(self.app.AsyncResult(task_id), "name", None) or "")

    # -- reading (blocking, in a worker thread) --------------------------------

    def _wait(self, task_id: str, tool: str, run_id: str, call_id: str,
              changes: Callable[[CallReport], None] | None, result_wait: float,
              stop: threading.Event) -> CallReport:
        started = time.monotonic()
        last: CallStatus | None = None
        while True:
            report = self.observe(task_id, tool, run_id, call_id, self.tick)
            waited = time.monotonic() - started
            if report.status.ended or stop.is_set():
                return report
            if report.status is not last and changes is not None:
                changes(report)
            last = report.status
            if report.status is CallStatus.AWAITING_APPROVAL and waited >= self.approval_wait:
                return report
            if waited >= result_wait:
                return report

    def observe(self, task_id: str, tool: str = "", run_id: str = "", call_id: str = "",
                wait: float = 0.0) -> CallReport:
        """How ``task_id`` stands, after waiting up to ``wait`` seconds for its
        result (blocking)."""
        result = self.app.AsyncResult(task_id)
        try:
            if wait > 0:
                with contextlib.suppress(ResultTimeout):  # not ready yet: say how it stands
                    result.get(timeout=wait, propagate=False, disable_sync_subtasks=False)
            state = result.state
            value = result.result if state in celery_states.READY_STATES else None
        finally:
            remove = getattr(result.backend, "remove_pending_result", None)
            if remove is not None:  # an async backend's subscription of a result not ready
                remove(result)
        runtime = runtime_for(self.app)
        base = CallReport(task_id, tool or str(getattr(result, "name", None) or ""),
                          CallStatus.QUEUED, run_id, call_id,
                          max_result_bytes=self.max_result_bytes)
        if state == celery_states.SUCCESS:
            return replace(base, status=CallStatus.SUCCEEDED, result=value)
        if state == celery_states.REVOKED:
            return replace(base, status=CallStatus.REVOKED, error_type="TaskRevokedError",
                           error=str(value))
        if state == celery_states.FAILURE and isinstance(value, ApprovalRejected):
            return replace(base, status=CallStatus.REJECTED, error_type="ApprovalRejected",
                           error=str(value), failure_class="client_error")
        letter = runtime.dead_letters.get(task_id)
        if state == celery_states.FAILURE and letter is None:
            deadline = time.monotonic() + LETTER_WAIT
            while letter is None and time.monotonic() < deadline:
                time.sleep(0.05)
                letter = runtime.dead_letters.get(task_id)
        if letter is not None:
            error_type = letter.exception_type or (type(value).__name__ if value else "")
            return replace(
                base, status=CallStatus.DEAD_LETTERED, tool=base.tool or letter.name,
                run_id=run_id or letter.run_id, error_type=error_type.rsplit(".", 1)[-1],
                error=letter.error or str(value or ""), failure_class=letter.failure_class,
                dead_letter_reason=letter.reason, body_completed=letter.body_completed)
        if state == celery_states.FAILURE:
            failure_class = (value.failure_class if isinstance(value, DeadLettered)
                             else runtime.classifier.classify(value).value
                             if isinstance(value, BaseException) else "unknown")
            return replace(base, status=CallStatus.FAILED, error_type=type(value).__name__,
                           error=str(value), failure_class=failure_class)
        approval = runtime.approvals.get(task_id)
        if approval is not None and approval.state in (ApprovalState.PENDING,
                                                       ApprovalState.USER_APPROVED):
            return replace(base, status=CallStatus.AWAITING_APPROVAL,
                           tool=base.tool or approval.name, run_id=run_id or approval.run_id,
                           approver=approval.approver or "operator",
                           approval_state=approval.state.value)
        if state in (celery_states.STARTED, celery_states.RETRY):
            return replace(base, status=CallStatus.RUNNING)
        if run_id:
            entry = runtime.journal.read(JournalRef(run_id, task_id))
            if entry.get("state") in (JournalState.RUNNING, JournalState.RETRY_SCHEDULED):
                return replace(base, status=CallStatus.RUNNING)
        return base


_callers: weakref.WeakKeyDictionary[Any, ToolCaller] = weakref.WeakKeyDictionary()


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _clip(text: str, limit: int) -> str:
    """``text``'s first ``limit`` UTF-8 bytes (never half a character)."""
    data = text.encode("utf-8", "surrogatepass")
    return text if len(data) <= limit else data[:limit].decode("utf-8", "ignore")


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)
