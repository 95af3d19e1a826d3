"""Signal handlers that give what the worker reports a failure class.

``task_failure`` fires for every failure Celery reports: a tool's own error
(stored by Celery's tracer in the pool process, also when the tool made the
call a dead letter), the dead-lettering ``Reject`` of a failure of the
package's own (whose ``reason`` is the error behind it), and the hard time
limits and lost workers seen only by the main process. The handler
classifies it, logs the class, and audits failures that ``ToolTask`` itself
never saw (raised by Celery around the task). It is connected once, when the
first ``ToolTask`` is bound.

Before a write tool's message is published (``before_task_publish``, in the
producer's process: ``apply_async``, ``send_task`` and Celery's own retries),
it stamps the time on it (``tooleffect_sent_at``): what tells a message
published after a detected rollback of the store from one that may have run
before it (:mod:`celery_tooleffect.store.rollback`).

In the pool process it also hands a dead letter the tool decided to the
worker's main process: Celery stores the failure on the result backend
*before* this signal fires, and returns the ``ExceptionInfo`` it is given
to the main process after it, so the letter rides there and never reaches
the backend (see :mod:`celery_tooleffect.worker.handoff`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.signals import before_task_publish, task_failure

from ..errors import DeadLettered
from ..store.audit import StepContext, worker_identity
from ..store.rollback import SENT_AT_HEADER
from ..store.runtime import runtime_for
from .attempt import caller_of, queue_name, resolve_run_id
from .handoff import existing_notes, send_letter

logger = logging.getLogger(__name__)

#: The names of the write tools bound in this process: their messages are stamped.
_STAMPED: set[str] = set()


def connect_signals() -> None:
    """Connect the package's handlers (idempotent)."""
    task_failure.connect(
        classify_reported_failure, weak=False, dispatch_uid="celery_tooleffect.task_failure"
    )
    before_task_publish.connect(
        stamp_publish_time, weak=False, dispatch_uid="celery_tooleffect.before_task_publish"
    )


def stamp_sent_at(name: str) -> None:
    """Stamp the messages of tool ``name`` with the time they are published."""
    _STAMPED.add(name)


def stamp_publish_time(sender: Any = None, headers: dict[str, Any] | None = None,
                       **_: Any) -> None:
    """``before_task_publish``: the publish time on a write tool's message (a
    republish of the message, as a retry, stamps it anew)."""
    if headers is not None and sender in _STAMPED:
        headers[SENT_AT_HEADER] = round(time.time(), 6)


def classify_reported_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
    einfo: Any = None, **_: Any,
) -> None:
    """Log the class of a tool's reported failure; audit it if nobody did.

    In the pool process, a dead letter the tool decided with its own error
    as Celery's result waits in the attempt's notes: it is moved onto
    ``einfo``, the ``ExceptionInfo`` Celery's tracer returns to the worker's
    main process (after the result backend stored the error; so it never
    reaches it)."""
    effect = getattr(sender, "tool_effect", None)
    if effect is None or exception is None or task_id is None:
        return
    decided = einfo is not None and send_letter(getattr(sender, "request", None), einfo)
    try:
        runtime = runtime_for(sender.app)
        failure_class = runtime.classifier.classify(exception)
        logger.warning(
            "tool %s[%s] failed: failure_class=%s exception=%s",
            sender.name, task_id, failure_class.value, type(exception).__name__,
        )
        if decided or isinstance(exception, DeadLettered) or _audited(sender, exception):
            return  # the tool audited how it ended
        fields = vars(sender.request)
        context = StepContext(
            run_id=resolve_run_id(fields, task_id),
            task_id=task_id,
            tool=sender.name,
            effect=effect,
            queue=queue_name(fields.get("delivery_info"), runtime.settings.default_queue),
            redelivered=False,
            worker=worker_identity(),
            caller=caller_of(fields),
        )
        runtime.audit.record_step(
            context.event(
                "failure_reported", "failed", exception=exception,
                failure_class=failure_class.value,
            )
        )
    except Exception:  # a signal handler must never break the worker
        logger.exception("could not classify the failure of %s", task_id)


def _audited(sender: Any, exception: BaseException) -> bool:
    """Whether the package audited ``exception`` already: noted in the attempt
    that ended with it (``sender.request``, the request Celery reports it for,
    in this process)."""
    notes = existing_notes(getattr(sender, "request", None))
    return notes is not None and notes.audited is exception
