"""Declaring effects, resolving them by name, and refusing every relabelling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_tooleffect import (
    ConfigurationError,
    DeadLetters,
    EffectRelabelRefused,
    ToolDeclarationError,
    ToolEffect,
    ToolEffectInterface,
    ToolEffectResolver,
    ToolTask,
)
from tests.conftest import Counter, running_worker, wait_for


def test_effect_values_and_properties() -> None:
    assert [e.value for e in ToolEffect] == [
        "read_only", "idempotent_write", "non_idempotent_write"
    ]
    assert not ToolEffect.READ_ONLY.is_write
    assert ToolEffect.IDEMPOTENT_WRITE.is_write and ToolEffect.NON_IDEMPOTENT_WRITE.is_write
    assert ToolEffect.READ_ONLY.safe_to_retry and ToolEffect.IDEMPOTENT_WRITE.safe_to_retry
    assert not ToolEffect.NON_IDEMPOTENT_WRITE.safe_to_retry


@pytest.mark.parametrize(
    ("effect", "expected"),
    [
        (ToolEffect.READ_ONLY, (True, True, False)),
        (ToolEffect.IDEMPOTENT_WRITE, (False, True, True)),
        (ToolEffect.NON_IDEMPOTENT_WRITE, (False, False, True)),
    ],
)
def test_mcp_annotations_always_carry_all_four_hints(
    effect: ToolEffect, expected: tuple[bool, bool, bool]
) -> None:
    hints = effect.mcp_annotations()
    assert set(hints) == {"readOnlyHint", "idempotentHint", "destructiveHint", "openWorldHint"}
    assert (hints["readOnlyHint"], hints["idempotentHint"], hints["destructiveHint"]) == expected
    assert hints["openWorldHint"] is True
    assert effect.mcp_annotations(open_world=False)["openWorldHint"] is False


def test_every_way_of_declaring_an_effect(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(base=ToolTask, shared=False)
    def undeclared() -> None: ...

    @app.task(base=ToolTask, effect=ToolEffect.NON_IDEMPOTENT_WRITE, shared=False)
    def by_option() -> None: ...

    @app.task(base=ToolTask, effect="idempotent_write", shared=False)
    def by_string() -> None: ...

    class WriteTool(ToolTask):
        abstract = True
        effect = ToolEffect.IDEMPOTENT_WRITE

    @app.task(base=WriteTool, shared=False)
    def by_subclass() -> None: ...

    class ComputedTool(ToolTask):
        abstract = True

        def get_effect(self) -> ToolEffect:
            return ToolEffect.NON_IDEMPOTENT_WRITE

    @app.task(base=ComputedTool, shared=False, open_world=False)
    def by_method() -> None: ...

    @app.task(shared=False)
    def plain_celery_task() -> None: ...

    resolver = ToolEffectResolver(app)
    assert resolver.effect_for(undeclared.name) is ToolEffect.READ_ONLY
    assert resolver.effect_for(by_option.name) is ToolEffect.NON_IDEMPOTENT_WRITE
    assert resolver.effect_for(by_string.name) is ToolEffect.IDEMPOTENT_WRITE
    assert resolver.effect_for(by_subclass.name) is ToolEffect.IDEMPOTENT_WRITE
    assert resolver.effect_for(by_method.name) is ToolEffect.NON_IDEMPOTENT_WRITE
    assert resolver.effect_for(plain_celery_task.name) is ToolEffect.READ_ONLY
    assert resolver.effect_for("no.such.tool") is ToolEffect.NON_IDEMPOTENT_WRITE
    assert isinstance(app.tasks[by_method.name], ToolEffectInterface)
    assert app.tasks[by_method.name].mcp_annotations()["openWorldHint"] is False


def test_an_invalid_effect_is_a_clear_error(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(base=ToolTask, effect="writes_a_bit", shared=False)
    def vague() -> None: ...

    with pytest.raises(ValueError, match="not a tool effect: 'writes_a_bit'"):
        app.tasks[vague.name]


@pytest.mark.parametrize(
    "annotation",
    [
        {"effect": "read_only"},
        {"acks_late": False},
        {"reject_on_worker_lost": False},
        {"retry_on_worker_lost": True},
        {"acks_on_failure_or_timeout": True},
        {"Request": "celery.worker.request:Request"},
        {"operation_deadline": 1},
    ],
)
def test_task_annotations_cannot_relabel_a_tool(
    make_app: Callable[..., Celery], annotation: dict[str, Any]
) -> None:
    app = make_app(task_annotations={"tools.send_invoice": annotation})

    @app.task(base=ToolTask, name="tools.send_invoice", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send_invoice() -> None: ...

    with pytest.raises(EffectRelabelRefused, match="task_annotations may not set"):
        app.tasks["tools.send_invoice"]


def test_harmless_annotations_still_apply(make_app: Callable[..., Celery]) -> None:
    app = make_app(task_annotations={"tools.search": {"rate_limit": "10/s"}})

    @app.task(base=ToolTask, name="tools.search", shared=False)
    def search() -> None: ...

    assert app.tasks["tools.search"].rate_limit == "10/s"


def test_configuration_cannot_relabel_a_tool(make_app: Callable[..., Celery]) -> None:
    app = make_app(tooleffect_effects={"tools.send_invoice": "read_only"})

    @app.task(base=ToolTask, name="tools.send_invoice", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send_invoice() -> None: ...

    with pytest.raises(ConfigurationError, match="unknown setting"):
        app.tasks["tools.send_invoice"]


def test_time_limit_longer_than_the_deadline_is_refused(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(base=ToolTask, shared=False, effect=ToolEffect.NON_IDEMPOTENT_WRITE,
              operation_deadline=10, time_limit=60)
    def slow_write() -> None: ...

    with pytest.raises(ToolDeclarationError, match="longer than its operation_deadline"):
        app.tasks[slow_write.name]


@pytest.mark.parametrize(
    "options",
    [
        {"effect": "read_only"},
        {"acks_late": False},
        {"headers": {"tooleffect_effect": "read_only"}},
        {"headers": {"tooleffect_token": "forged"}},
        {"tooleffect_effect": "read_only"},
    ],
)
def test_call_options_cannot_relabel_a_tool(
    make_app: Callable[..., Celery], options: dict[str, Any]
) -> None:
    app = make_app()

    @app.task(base=ToolTask, shared=False, effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send_invoice() -> None: ...

    with pytest.raises(EffectRelabelRefused, match="a call may not set"):
        send_invoice.apply_async((), **options)
    with pytest.raises(EffectRelabelRefused, match="a call may not set"):
        send_invoice.apply((), **options)


@pytest.mark.parametrize("header", ["tooleffect_effect", "tooleffect_token", "TOOLEFFECT_skip"])
def test_a_message_with_forged_headers_is_dead_lettered_unrun(
    make_app: Callable[..., Celery], counter: Counter, header: str
) -> None:
    app = make_app()

    @app.task(base=ToolTask, name="tools.send_invoice", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send_invoice(key: str) -> str:
        counter.hit(key)
        return key

    with running_worker(app):
        # A producer that bypasses ToolTask.apply_async (another language,
        # a raw publish) and sets a reserved header.
        forged = app.send_task("tools.send_invoice", args=["k"],
                               headers={header: "read_only"}, queue="tools")
        letter = wait_for(lambda: DeadLetters(app).get(forged.id), what="the dead letter")
        fine = send_invoice.delay("ok")
        assert fine.get(timeout=20) == "ok"
    assert counter.value("k") == 0
    assert letter.reason == "malformed_message"
    assert letter.failure_class == "client_error"
    assert header in letter.error


def test_wrong_arguments_are_dead_lettered_unrun(
    make_app: Callable[..., Celery], counter: Counter
) -> None:
    app = make_app()

    @app.task(base=ToolTask, name="tools.send_invoice", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send_invoice(customer_id: str, amount_cents: int) -> str:
        counter.hit(customer_id)
        return customer_id

    with running_worker(app):
        bad = app.send_task("tools.send_invoice", args=["c1"], kwargs={"colour": "red"},
                            queue="tools")
        letter = wait_for(lambda: DeadLetters(app).get(bad.id), what="the dead letter")
        fine = send_invoice.delay("c2", 100)
        assert fine.get(timeout=20) == "c2"
    assert counter.value("c1") == 0
    assert letter.reason == "malformed_message"
    assert "invalid arguments" in letter.error
    assert letter.kwargs == {"colour": "red"}
