"""One delivery of one tool call in the pool process: what every step of its
protocol reads (the tool, the request, its arguments, the store, the attempt
it is handled as).

:class:`~celery_tooleffect.worker.execution.Execution` runs it; the endings
(:mod:`~celery_tooleffect.worker.endings`) and the reconcile path
(:mod:`~celery_tooleffect.worker.interrupted`) take it as it stands.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Protocol

from celery.app.task import Context

from ..effect import ToolEffect
from ..errors import StoreUnavailable
from ..identity import call_digest, publish_digest
from ..store import states
from ..store.audit import describe_payload
from ..store.runtime import ToolRuntime
from .attempt import Attempt, handled_as, new_token
from .handoff import attempt_notes, handoff_of
from .retries import RetryPolicy

logger = logging.getLogger(__name__)


class Tool(Protocol):
    """What the protocol reads of a tool (``ToolTask`` provides it)."""

    name: str
    request: Context
    operation_deadline: float | None

    @property
    def tool_effect(self) -> ToolEffect: ...

    @property
    def retry_policy(self) -> RetryPolicy: ...

    @property
    def runtime(self) -> ToolRuntime: ...

    def signature_from_request(self, *args: Any, **kwargs: Any) -> Any: ...

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any: ...

    def run(self, *args: Any, **kwargs: Any) -> Any: ...

    def needs_approval(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool: ...


def tool_body(tool: Tool) -> Any:
    """The tool's own ``run``, without Celery's ``autoretry_for`` wrapper.

    ``@app.task(autoretry_for=...)`` wraps ``run`` to call ``self.retry()``
    (celery/app/autoretry.py) and keeps the original as ``_orig_run``; a
    tool's retries are decided by its
    :class:`~celery_tooleffect.worker.retries.RetryPolicy` instead, which
    reads the same options and spends the tool's one budget.
    """
    return tool.__dict__.get("_orig_run") or tool.run


def run_signature(tool: Tool) -> inspect.Signature:
    """The signature of the bound body (``bind=True`` tools do not count ``self``)."""
    # Kept in the instance's own __dict__: each registered tool is its own
    # instance, and a subclass tool must not find its parent's.
    signature = tool.__dict__.get("_signature")
    if signature is None:
        signature = inspect.signature(tool_body(tool))
        tool.__dict__["_signature"] = signature
    return signature


class Delivery:
    """One delivery of one tool call: its tool, request, arguments and attempt."""

    def __init__(
        self, tool: Tool, request: Context, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.tool = tool
        self.request = request
        self.args = args
        self.kwargs = kwargs
        self.runtime = tool.runtime
        self.policy = tool.retry_policy
        #: What the worker's main process handed over with a queued call
        #: (worker/handoff.py); None for an interactive one.
        self.handoff = handoff_of(request)
        self.attempt = Attempt.of(
            vars(request),
            task_id=str(request.id),
            name=tool.name,
            effect=tool.tool_effect,
            delivery_info=request.delivery_info,
            default_queue=self.runtime.settings.default_queue,
            token=self.handoff.token if self.handoff is not None else new_token(),
            interactive=bool(request.is_eager or request.called_directly),
            retries=int(request.retries or 0),
        )
        #: The call's arguments as its events describe them (:meth:`payload`).
        self._arguments: dict[str, str] | None = None
        self._call_digest: str | None = None
        #: The acknowledgement of this delivery that rides with its success
        #: (the main process asked for it: the broker is the store's Redis).
        self.ack = (self.runtime.leases.broker_ack(request.properties)
                    if self.handoff is not None and self.handoff.ack_in_pool
                    and not self.attempt.interactive else None)

    @property
    def label(self) -> str:
        return f"{self.tool.name}[{self.attempt.task_id}]"

    def handle_as(self, recorded: ToolEffect | str | None) -> None:
        """Handle this call under the effect :func:`handled_as` decides from the
        one ``recorded`` (by another release, in the journal), saying so."""
        declared = self.attempt.effect
        self.attempt = handled_as(self.attempt, recorded)
        effect = self.attempt.effect
        if effect is not declared:
            logger.warning("%s is declared %s here but recorded %s by another release: "
                           "handled as %s", self.label, declared.value, effect.value,
                           effect.value)

    def payload(self, **values: Any) -> dict[str, str]:
        """The call's arguments (and ``values``) as the privacy setting allows.

        The arguments are described once per call, as they were when it
        began (the intent's event and the outcome's carry the same text)."""
        arguments = self._arguments
        if arguments is None:
            arguments = self._arguments = describe_payload(
                self.runtime.settings.privacy, args=self.args, kwargs=self.kwargs)
        if not values:
            return dict(arguments)
        return {**arguments, **describe_payload(self.runtime.settings.privacy, **values)}

    def digest(self) -> str:
        """The digest of this call's arguments (:mod:`celery_tooleffect.identity`):
        of the decoded ones for a queued call; an interactive call's go through
        the app's serializer first, which raises what Celery's publish would
        for arguments it cannot encode, before anything runs."""
        digest = self._call_digest
        if digest is None:
            if self.attempt.interactive:
                digest = publish_digest(self.args, self.kwargs, self.serializer)
            else:
                digest = call_digest(self.args, self.kwargs)
            self._call_digest = digest
        return digest

    @property
    def serializer(self) -> str:
        return str(getattr(self.tool, "serializer", None) or "json")

    def acknowledged(self) -> None:
        """The script that recorded the success acknowledged the message too."""
        if self.ack is not None:
            attempt_notes(self.request).acknowledged = True

    def already_ended(self) -> bool:
        """Whether the journal, read when it cannot be written, says the task ended.

        A store that refuses writes (out of memory, read-only replica, ACL) still
        answers reads: a delivery of a task that succeeded or was dead-lettered is
        then acknowledged without running, as it is when the store is healthy,
        instead of being retried until its budget is spent and dead-lettered.
        """
        try:
            state = self.runtime.journal.read(self.attempt.ref).get("state")
        except StoreUnavailable:
            return False
        return state in states.ENDED

    def already_dead_lettered(self) -> bool:
        """Whether the task is a dead letter (False when that cannot be read)."""
        try:
            return self.runtime.dead_letters.exists(self.attempt.task_id)
        except StoreUnavailable:
            return False
