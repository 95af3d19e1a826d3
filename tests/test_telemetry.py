"""OpenTelemetry tool spans and metrics, on a real (in-process) worker.

The OpenTelemetry SDK's in-memory exporters collect what the worker emits, and
Celery's own instrumentation (``opentelemetry-instrumentation-celery``) is on,
so the tool span's parent is Celery's ``run/{task}`` span and the trace comes
from the message's headers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_tooleffect import Approvals, DeadLetters, ToolEffect, ToolTask
from celery_tooleffect.admin.operations import DeadLetterOperations
from tests.conftest import Counter, running_worker, wait_for

pytestmark = [
    pytest.mark.timeout(120),
    # Under pytest-xdist (--dist loadgroup) the whole module runs on one worker,
    # one test after another: its module fixture sets OpenTelemetry's global
    # providers, which a process accepts once only, so a second set-up (the
    # module's tests split among workers or interleaved with others) would
    # leave the tool spans in the first set-up's exporter.
    pytest.mark.xdist_group("telemetry"),
]


class Telemetry:
    def __init__(self, spans: InMemorySpanExporter, metrics: InMemoryMetricReader) -> None:
        self.exporter = spans
        self.reader = metrics

    def tool_spans(self, task_id: str) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans()
                if span.name.startswith("execute_tool ")
                and (span.attributes or {}).get("gen_ai.tool.call.id") == task_id]

    def span_by_id(self, span_id: int) -> ReadableSpan | None:
        return next((span for span in self.exporter.get_finished_spans()
                     if span.context is not None and span.context.span_id == span_id), None)

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found


@pytest.fixture(scope="module")
def telemetry() -> Iterator[Telemetry]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    yield Telemetry(exporter, reader)
    instrumentor.uninstrument()


class Flaky(Exception):
    failure_class = "connection"


class Refused(Exception):
    failure_class = "client_error"


def tools(app: Celery, counter: Counter) -> dict[str, Any]:
    @app.task(base=ToolTask, name="otel.read", shared=False)
    def read(key: str) -> str:
        counter.hit(key)
        return key

    @app.task(base=ToolTask, name="otel.write", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def write(key: str) -> str:
        counter.hit(key)
        return key.upper()

    @app.task(base=ToolTask, name="otel.flaky", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def flaky(key: str) -> str:
        if counter.hit(key) == 1:
            raise Flaky("the provider timed out")
        return key

    @app.task(base=ToolTask, name="otel.refused", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE)
    def refused(key: str) -> str:
        if counter.hit(key) == 1:
            raise Refused("no such customer")
        return key

    @app.task(base=ToolTask, name="otel.approved", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True)
    def approved(key: str) -> str:
        counter.hit(key)
        return key

    return {"read": read, "write": write, "flaky": flaky, "refused": refused,
            "approved": approved}


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def event_names(span: ReadableSpan) -> list[str]:
    return [event.name for event in span.events]


def test_a_read_and_a_write_are_one_span_each_under_celerys_task_span(
    make_app: Callable[..., Celery], counter: Counter, telemetry: Telemetry,
) -> None:
    app = make_app()
    tool = tools(app, counter)
    key = uuid.uuid4().hex[:8]
    with running_worker(app):
        read, write = tool["read"].delay(key), tool["write"].delay(key)
        assert read.get(timeout=30) == key and write.get(timeout=30) == key.upper()

    [read_span] = wait_for(lambda: telemetry.tool_spans(read.id), what="the read's span")
    assert read_span.name == "execute_tool otel.read"
    assert attributes(read_span) == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "otel.read",
        "gen_ai.tool.call.id": read.id, "gen_ai.tool.type": "function",
        "tooleffect.effect": "read_only", "tooleffect.run_id": read.id,
        "tooleffect.attempt": 1, "tooleffect.outcome": "succeeded",
    }
    assert read_span.parent is not None
    celery_span = telemetry.span_by_id(read_span.parent.span_id)
    assert celery_span is not None and celery_span.name == "run/otel.read"

    [write_span] = wait_for(lambda: telemetry.tool_spans(write.id), what="the write's span")
    written = attributes(write_span)
    assert written["tooleffect.effect"] == "non_idempotent_write"
    assert len(str(written["tooleffect.idempotency_key"])) == 32
    assert "gen_ai.tool.call.arguments" not in written  # privacy: metadata
    [intent] = [event for event in write_span.events if event.name == "intent recorded"]
    assert (intent.attributes or {})["tooleffect.fencing_token"] == 1

    durations = [point for point in telemetry.points("gen_ai.execute_tool.duration")
                 if point.attributes.get("gen_ai.tool.name") == "otel.write"]
    assert durations and durations[0].attributes["tooleffect.outcome"] == "succeeded"
    assert sum(point.count for point in durations) >= 1


def test_a_retried_write_is_two_spans_in_one_trace(
    make_app: Callable[..., Celery], counter: Counter, telemetry: Telemetry,
) -> None:
    app = make_app()
    tool = tools(app, counter)
    key = uuid.uuid4().hex[:8]
    with running_worker(app):
        result = tool["flaky"].delay(key)
        assert result.get(timeout=30) == key

    spans = wait_for(lambda: len(telemetry.tool_spans(result.id)) == 2
                     and telemetry.tool_spans(result.id), what="the flaky tool's two spans")
    by_attempt = {attributes(span)["tooleffect.attempt"]: span for span in spans}
    first, second = by_attempt[1], by_attempt[2]
    assert attributes(first)["tooleffect.outcome"] == "retry_scheduled"
    assert attributes(first)["error.type"] == "Flaky"
    assert "retry scheduled" in event_names(first)
    assert attributes(second)["tooleffect.outcome"] == "succeeded"
    assert first.context is not None and second.context is not None
    assert first.context.trace_id == second.context.trace_id


def test_a_dead_letter_and_its_replay_share_the_callers_trace(
    make_app: Callable[..., Celery], counter: Counter, telemetry: Telemetry,
) -> None:
    app = make_app()
    tool = tools(app, counter)
    key = uuid.uuid4().hex[:8]
    tracer = trace.get_tracer("agent")
    with running_worker(app):
        with tracer.start_as_current_span("agent run") as agent:
            result = tool["refused"].delay(key)
        wait_for(lambda: DeadLetters(app).get(result.id), what="the dead letter")
        replayed = DeadLetterOperations(app).replay(result.id, actor="test")
        assert replayed.ok, replayed.message
        # The backend holds the dead letter's FAILURE until the replay's run
        # stores SUCCESS (a fresh AsyncResult each time: get() would return the
        # FAILURE at once if it read before the run).
        wait_for(lambda: app.AsyncResult(result.id).state == "SUCCESS", timeout=30,
                 what="the replay to succeed")
        assert app.AsyncResult(result.id).get(timeout=30) == key

    spans = wait_for(lambda: [s for s in telemetry.tool_spans(result.id)
                              if attributes(s).get("tooleffect.outcome") == "succeeded"]
                     and telemetry.tool_spans(result.id), what="both spans")
    dead = next(s for s in spans if attributes(s)["tooleffect.outcome"] == "dead_lettered")
    again = next(s for s in spans if attributes(s)["tooleffect.outcome"] == "succeeded")
    assert attributes(dead)["tooleffect.dead_letter.reason"] == "not_retryable"
    assert attributes(dead)["tooleffect.failure_class"] == "client_error"
    assert attributes(dead)["error.type"] == "Refused"
    assert dead.status.status_code is trace.StatusCode.ERROR
    assert "dead-lettered" in event_names(dead)
    trace_id = agent.get_span_context().trace_id
    assert dead.context is not None and again.context is not None
    # The replay publishes the message as delivered: its headers carry the
    # caller's trace, so the replayed run is in it too.
    assert dead.context.trace_id == again.context.trace_id == trace_id

    outcomes = {(p.attributes["tooleffect.outcome"], p.attributes["tooleffect.failure_class"])
                for p in telemetry.points("tooleffect.tool.outcomes")
                if p.attributes["gen_ai.tool.name"] == "otel.refused"}
    assert {("dead_lettered", "client_error"), ("succeeded", "none")} <= outcomes


def test_a_parked_call_has_a_span_with_its_approval_request(
    make_app: Callable[..., Celery], counter: Counter, telemetry: Telemetry,
) -> None:
    app = make_app()
    tool = tools(app, counter)
    key = uuid.uuid4().hex[:8]
    tracer = trace.get_tracer("agent")
    with running_worker(app):
        with tracer.start_as_current_span("agent run") as agent:
            result = tool["approved"].delay(key)
        wait_for(lambda: Approvals(app).get(result.id), what="the call to be parked")
        [parked] = wait_for(lambda: telemetry.tool_spans(result.id), what="its span")
        assert Approvals(app).approve(result.id, by="alice").ok
        assert result.get(timeout=30) == key

    assert attributes(parked)["tooleffect.outcome"] == "awaiting_approval"
    assert event_names(parked) == ["approval requested"]
    assert parked.context is not None
    assert parked.context.trace_id == agent.get_span_context().trace_id
    ran = [s for s in telemetry.tool_spans(result.id)
           if attributes(s).get("tooleffect.outcome") == "succeeded"]
    assert len(ran) == 1 and counter.value(key) == 1


def test_full_privacy_adds_arguments_and_result(
    make_app: Callable[..., Celery], counter: Counter, telemetry: Telemetry,
) -> None:
    app = make_app(tooleffect_privacy="full")
    tool = tools(app, counter)
    key = uuid.uuid4().hex[:8]
    with running_worker(app):
        result = tool["write"].delay(key)
        assert result.get(timeout=30) == key.upper()
    [span] = wait_for(lambda: telemetry.tool_spans(result.id), what="the span")
    arguments = attributes(span)["gen_ai.tool.call.arguments"]
    assert json.loads(str(arguments)) == {"args": [key], "kwargs": {}}
    assert attributes(span)["gen_ai.tool.call.result"] == f'"{key.upper()}"'
