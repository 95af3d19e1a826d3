"""OpenTelemetry tool spans and metrics, when ``opentelemetry-api`` is installed.

Each tool call is one span, ``execute_tool {tool}``, as OpenTelemetry's GenAI
semantic conventions (status: development) describe a tool execution:
``gen_ai.operation.name`` (set when the span starts), ``gen_ai.tool.name``,
``gen_ai.tool.call.id`` (the task id), ``gen_ai.tool.type`` (``function``),
``error.type`` when it fails; arguments and result
(``gen_ai.tool.call.arguments``, ``gen_ai.tool.call.result``) only when
``tooleffect_privacy`` is ``full``. The package adds ``tooleffect.effect``,
``tooleffect.run_id``, ``tooleffect.attempt``, ``tooleffect.idempotency_key``
(writes), ``tooleffect.outcome``, ``tooleffect.failure_class`` and
``tooleffect.dead_letter.reason``, and span events for the steps of the
attempt (intent recorded, lease secured, extended or failed, retry scheduled,
deferred, dead-lettered, reconciled, approval requested).

The span is started in the current context: under Celery's own
instrumentation (``opentelemetry-instrumentation-celery``) that is the task's
``run/{name}`` span, whose trace comes from the message's headers, so a
retried, deferred or replayed call (its message keeps or carries those
headers) stays in the caller's trace.

Metrics, through the global meter provider: the histogram
``gen_ai.execute_tool.duration`` (seconds; by tool, effect, outcome), the
counters ``tooleffect.tool.outcomes`` (by tool, effect, outcome, failure
class), ``tooleffect.audit.write_failures`` (``read``: a read's fail-soft
event lost; ``write``: a write failed closed) and
``tooleffect.lease.extensions`` (``ok``, ``failed``).

Without the package (the ``otel`` extra not installed) nothing is imported
and every entry point is a no-op decided once, at import.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, Retry

from ..errors import DeadLettered

if TYPE_CHECKING:
    from .attempt import Attempt

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - exercised by the compatibility sessions
    otel_trace = None  # type: ignore[assignment]

#: Whether OpenTelemetry is installed (decided once).
ENABLED = otel_trace is not None

_NAME = "celery_tooleffect"
_FULL_LIMIT = 64 * 1024


@functools.cache
def _tracer() -> Any:
    # The API's proxy tracer: it follows a tracer provider set later.
    return otel_trace.get_tracer(_NAME)


class _Instruments:
    """The package's metric instruments, made on first use from the global meter
    provider (an SDK configured after import is still used)."""

    def __init__(self) -> None:
        meter = otel_metrics.get_meter(_NAME)
        self.duration = meter.create_histogram(
            "gen_ai.execute_tool.duration", unit="s",
            description="How long a tool call took, from its start to its ending",
        )
        self.outcomes = meter.create_counter(
            "tooleffect.tool.outcomes", unit="{call}",
            description="Tool calls by how they ended",
        )
        self.audit_failures = meter.create_counter(
            "tooleffect.audit.write_failures", unit="{event}",
            description="Audit records that could not be stored (read: fail-soft; "
                        "write: the write failed closed)",
        )
        self.lease_extensions = meter.create_counter(
            "tooleffect.lease.extensions", unit="{extension}",
            description="Lease renewals of running writes, by result",
        )


_instruments: _Instruments | None = None


def _meters() -> _Instruments:
    global _instruments
    if _instruments is None:
        _instruments = _Instruments()
    return _instruments


def _text(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except Exception:
        text = repr(value)
    return text[:_FULL_LIMIT]


class ToolCallSpan:
    """The span and the metrics of one tool call (a context manager).

    ``outcome`` is how the call ended (``succeeded``, ``failed``,
    ``dead_lettered``, ``retry_scheduled``, ``acknowledged``, ``requeued``),
    read from the exception that ends it, if any.
    """

    def __init__(self, attempt: Attempt, *, privacy: str, args: Any, kwargs: Any,
                 classify: Any) -> None:
        self.attempt = attempt
        self.privacy = privacy
        self.args = args
        self.kwargs = kwargs
        self.classify = classify
        self.span: Any = None
        self.token: Any = None
        self.started = 0.0
        self.result: Any = None

    def __enter__(self) -> ToolCallSpan:
        attempt = self.attempt
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": attempt.name,
            "gen_ai.tool.call.id": attempt.task_id,
            "gen_ai.tool.type": "function",
            "tooleffect.effect": attempt.effect.value,
            "tooleffect.run_id": attempt.run_id,
            "tooleffect.attempt": attempt.retries + 1,
        }
        if attempt.effect.is_write:
            attributes["tooleffect.idempotency_key"] = attempt.idempotency_key
        if self.privacy == "full":
            attributes["gen_ai.tool.call.arguments"] = _text(
                {"args": list(self.args), "kwargs": dict(self.kwargs)})
        self.span = _tracer().start_span(f"execute_tool {attempt.name}",
                                         kind=SpanKind.INTERNAL, attributes=attributes)
        self.token = otel_context.attach(otel_trace.set_span_in_context(self.span))
        self.started = time.perf_counter()
        return self

    def succeeded(self, result: Any) -> Any:
        """Note the result (shown only under privacy ``full``); returns it."""
        self.result = result
        return result

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        span, attempt = self.span, self.attempt
        outcome, failure_class, error_type = "succeeded", "", ""
        if isinstance(exc, Retry):
            outcome = "retry_scheduled"
            cause = exc.exc if isinstance(exc.exc, BaseException) else None
            error_type = type(cause).__qualname__ if cause is not None else ""
        elif isinstance(exc, DeadLettered):
            outcome, failure_class = "dead_lettered", exc.failure_class
            cause = exc.reason if isinstance(exc.reason, BaseException) else exc
            error_type = type(cause).__qualname__
            span.set_attribute("tooleffect.dead_letter.reason", exc.dead_letter_reason)
        elif isinstance(exc, Ignore):
            outcome = "acknowledged"
        elif isinstance(exc, Reject):
            outcome = "requeued" if exc.requeue else "rejected"
        elif exc is not None:
            outcome, error_type = "failed", type(exc).__qualname__
            try:
                failure_class = str(self.classify(exc).value)
            except Exception:
                failure_class = "unknown"
        span.set_attribute("tooleffect.outcome", outcome)
        if failure_class:
            span.set_attribute("tooleffect.failure_class", failure_class)
        if error_type:
            span.set_attribute("error.type", error_type)
        if outcome in ("failed", "dead_lettered", "rejected"):
            span.set_status(Status(StatusCode.ERROR, str(exc)[:256]))
        elif outcome == "succeeded" and self.privacy == "full":
            span.set_attribute("gen_ai.tool.call.result", _text(self.result))
        otel_context.detach(self.token)
        span.end()
        labels = {"gen_ai.tool.name": attempt.name, "tooleffect.effect": attempt.effect.value,
                  "tooleffect.outcome": outcome}
        meters = _meters()
        meters.duration.record(time.perf_counter() - self.started, labels)
        meters.outcomes.add(1, {**labels, "tooleffect.failure_class": failure_class or "none"})


class _NoSpan:
    """What :func:`tool_call_span` gives without OpenTelemetry: nothing."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def succeeded(self, result: Any) -> Any:
        return result


_NO_SPAN = _NoSpan()


def configured() -> bool:
    """Whether the application set a tracer or a meter provider: until it does,
    the API's providers are proxies that record nothing, and a call pays nothing
    for them (no span, no context switch)."""
    return ENABLED and not (
        isinstance(otel_trace.get_tracer_provider(), otel_trace.ProxyTracerProvider)
        and type(otel_metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
    )


def tool_call_span(attempt: Attempt, *, privacy: str, args: Any, kwargs: Any,
                   classify: Any) -> ToolCallSpan | _NoSpan:
    """The span of one call (:class:`ToolCallSpan`), or a no-op without OpenTelemetry
    (or before the application configured it)."""
    if not configured():
        return _NO_SPAN
    return ToolCallSpan(attempt, privacy=privacy, args=args, kwargs=kwargs, classify=classify)


def step(name: str, **attributes: Any) -> None:
    """A span event on the current span (the tool call's): one step of the attempt."""
    if ENABLED:
        otel_trace.get_current_span().add_event(
            name, {key: value for key, value in attributes.items() if value is not None})


def current_span() -> Any:
    """The current span, for a thread that adds events to it later (the heartbeat)."""
    return otel_trace.get_current_span() if ENABLED else None


def lease_extended(span: Any, *, ok: bool, reason: str = "") -> None:
    """A lease renewal of a running write (from the heartbeat thread)."""
    if not ENABLED:
        return
    if span is not None:
        span.add_event("lease extended" if ok else "lease failed",
                       {"reason": reason} if reason else {})
    _meters().lease_extensions.add(1, {"tooleffect.result": "ok" if ok else "failed"})


def audit_write_failed(kind: str, effect: str) -> None:
    """An audit record was not stored: ``read`` (fail-soft) or ``write`` (failed closed)."""
    if ENABLED:
        _meters().audit_failures.add(1, {"tooleffect.effect_kind": kind,
                                         "tooleffect.effect": effect})


def approval_requested(attempt: Attempt, headers: Mapping[str, Any] | None) -> None:
    """The span of a call parked for approval, in the worker's main process: a
    child of the caller's trace (from the message's headers, when a propagator
    put it there), with the event ``approval requested``."""
    if not ENABLED:
        return
    from opentelemetry import propagate

    parent = propagate.extract(dict(headers or {}))
    span = _tracer().start_span(
        f"execute_tool {attempt.name}", context=parent, kind=SpanKind.INTERNAL,
        attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": attempt.name,
            "gen_ai.tool.call.id": attempt.task_id, "gen_ai.tool.type": "function",
            "tooleffect.effect": attempt.effect.value, "tooleffect.run_id": attempt.run_id,
            "tooleffect.attempt": attempt.retries + 1,
            "tooleffect.outcome": "awaiting_approval",
        },
    )
    span.add_event("approval requested")
    span.end()
