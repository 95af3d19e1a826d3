"""The failure classifier: first match wins, optional libraries by name."""

from __future__ import annotations

import socket
from typing import Any

import kombu.exceptions
import pytest
import redis
from celery.exceptions import ImproperlyConfigured, Reject

from celery_tooleffect import (
    AuditPersistenceFailed,
    CircuitOpenError,
    DeadLettered,
    FailureClass,
    FailureClassifier,
    NoSideEffect,
)


def library_error(module: str, name: str, status: int | None = None) -> BaseException:
    """An exception whose class lives in ``module`` (a library not installed here)."""

    class Response:
        status_code = status

    exc_type: Any = type(name, (Exception,), {"__module__": module})
    exc = exc_type("from a library")
    if status is not None:
        exc.response = Response()
    return exc  # type: ignore[no-any-return]


def test_retryable_classes() -> None:
    retryable = {c for c in FailureClass if c.retryable}
    assert retryable == {
        FailureClass.CONNECTION, FailureClass.RATE_LIMIT,
        FailureClass.SERVER_ERROR, FailureClass.CIRCUIT_OPEN,
    }


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionRefusedError(), FailureClass.CONNECTION),
        (TimeoutError(), FailureClass.CONNECTION),
        (socket.gaierror(), FailureClass.CONNECTION),
        (redis.ConnectionError(), FailureClass.CONNECTION),
        (redis.TimeoutError(), FailureClass.CONNECTION),
        (kombu.exceptions.OperationalError(), FailureClass.CONNECTION),
        (library_error("requests.exceptions", "ConnectionError"), FailureClass.CONNECTION),
        (library_error("httpx", "TransportError"), FailureClass.CONNECTION),
        (library_error("requests.exceptions", "HTTPError", 401), FailureClass.AUTH),
        (library_error("httpx", "HTTPStatusError", 403), FailureClass.AUTH),
        (library_error("httpx", "HTTPStatusError", 429), FailureClass.RATE_LIMIT),
        (library_error("requests.exceptions", "HTTPError", 503), FailureClass.SERVER_ERROR),
        (library_error("requests.exceptions", "HTTPError", 404), FailureClass.CLIENT_ERROR),
        (library_error("pybreaker", "CircuitBreakerError"), FailureClass.CIRCUIT_OPEN),
        (CircuitOpenError(), FailureClass.CIRCUIT_OPEN),
        (ImproperlyConfigured(), FailureClass.CONFIGURATION),
        (FileNotFoundError(), FailureClass.UNKNOWN),
        (ValueError(), FailureClass.UNKNOWN),
        (AuditPersistenceFailed("lost"), FailureClass.UNKNOWN),
    ],
)
def test_builtin_knowledge(exc: BaseException, expected: FailureClass) -> None:
    assert FailureClassifier().classify(exc) is expected


def test_declared_attribute_wins_over_everything() -> None:
    class Throttled(ConnectionError):
        failure_class = "rate_limit"

    classifier = FailureClassifier()
    classifier.register(Throttled, FailureClass.AUTH)
    assert classifier.classify(Throttled()) is FailureClass.RATE_LIMIT


def test_registered_types_and_setting() -> None:
    class ProviderQuota(Exception):
        pass

    classifier = FailureClassifier()
    classifier.register(ProviderQuota, "rate_limit")
    assert classifier.classify(ProviderQuota()) is FailureClass.RATE_LIMIT

    from_setting = FailureClassifier.from_setting({"builtins.LookupError": "client_error"})
    assert from_setting.classify(KeyError("x")) is FailureClass.CLIENT_ERROR
    with pytest.raises(TypeError, match="not an exception"):
        FailureClassifier.from_setting({"builtins.len": "auth"})


def test_reject_and_no_side_effect_are_unwrapped() -> None:
    classifier = FailureClassifier()
    assert classifier.classify(Reject(ConnectionError(), requeue=False)) is FailureClass.CONNECTION
    assert classifier.classify(NoSideEffect(TimeoutError())) is FailureClass.CONNECTION
    dead = DeadLettered("x", "unknown", "not_retryable", reason=AuditPersistenceFailed("lost"))
    assert classifier.classify(dead) is FailureClass.UNKNOWN
