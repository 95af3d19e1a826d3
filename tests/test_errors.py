"""One error tree: everything the package raises is a ToolEffectError, and exported."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

from celery.exceptions import Ignore, ImproperlyConfigured, Reject

import celery_tooleffect
from celery_tooleffect import errors
from celery_tooleffect.errors import (
    ConfigurationError,
    DeadLettered,
    EffectRelabelRefused,
    LeaseLost,
    ToolDeclarationError,
    ToolEffectError,
)


def package_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module_info in pkgutil.walk_packages(celery_tooleffect.__path__, "celery_tooleffect."):
        if module_info.name.endswith(".flower") or module_info.name.startswith(
                "celery_tooleffect.demo"):
            # The flower extra's imports; the demo is user code (its tools'
            # exceptions are theirs; its worker_app needs the demo's variables).
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__ == module.__name__):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_the_package_defines_is_a_tool_effect_error() -> None:
    found = package_exceptions()
    assert len(found) >= 15
    outside = sorted(
        name for name, klass in found.items() if not issubclass(klass, ToolEffectError)
    )
    assert outside == []


def test_every_exception_is_defined_in_errors_exported_and_drawn_in_the_tree() -> None:
    drawn = errors.__doc__ or ""
    for name, klass in package_exceptions().items():
        assert klass.__module__ == "celery_tooleffect.errors", name
        assert klass.__name__ in celery_tooleffect.__all__, name
        assert klass.__name__ in drawn, name


def test_configuration_mistakes_are_celery_configuration_errors() -> None:
    for klass in (ConfigurationError, EffectRelabelRefused, ToolDeclarationError):
        assert issubclass(klass, ImproperlyConfigured)
        assert issubclass(klass, ToolEffectError)


def test_control_flow_exceptions_are_still_celerys() -> None:
    assert issubclass(DeadLettered, Reject)
    assert issubclass(LeaseLost, Ignore)
    letter = DeadLettered("boom in t[1]", "unknown", "not_retryable", reason=ValueError("x"))
    assert letter.requeue is False
    copy = pickle.loads(pickle.dumps(letter))
    assert (copy.description, copy.failure_class, copy.dead_letter_reason) == (
        "boom in t[1]", "unknown", "not_retryable"
    )
