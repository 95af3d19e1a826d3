"""Classification (celery_tooleffect/failures.py) beyond tests/test_failures.py:
HTTP statuses, the order of the rules, unwrapping, and an exception that
misbehaves while it is being classified."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import Reject
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.errors import NoSideEffect
from celery_tooleffect.failures import (
    FailureClass,
    FailureClassifier,
    is_no_side_effect,
)

PROPERTIES = settings(max_examples=300, deadline=None, database=None)


def http_error(status: Any, module: str = "httpx", name: str = "HTTPStatusError") -> Exception:
    class Response:
        status_code = status

    exc: Exception = type(name, (Exception,), {"__module__": module})("status")
    exc.response = Response()  # type: ignore[attr-defined]
    return exc


@PROPERTIES
@given(status=st.integers(-1000, 1000))
def test_every_http_status_has_one_class(status: int) -> None:
    found = FailureClassifier().classify(http_error(status))
    if status in (401, 403):
        assert found is FailureClass.AUTH
    elif status == 429:
        assert found is FailureClass.RATE_LIMIT
    elif 500 <= status <= 599:
        assert found is FailureClass.SERVER_ERROR and found.retryable
    elif 400 <= status <= 499:
        assert found is FailureClass.CLIENT_ERROR and not found.retryable
    else:
        assert found is FailureClass.UNKNOWN


def test_an_http_error_without_a_usable_status_is_unknown() -> None:
    classifier = FailureClassifier()
    assert classifier.classify(http_error("503")) is FailureClass.UNKNOWN
    assert classifier.classify(http_error(None, "requests.exceptions", "HTTPError")) is (
        FailureClass.UNKNOWN)

    class Broken(Exception):
        __module__ = "httpx"
        __qualname__ = "HTTPStatusError"

        @property
        def response(self) -> Any:
            raise RuntimeError("no response")

    assert classifier.classify(Broken()) is FailureClass.UNKNOWN


def test_a_subclass_of_a_library_error_is_that_library_s_error() -> None:
    base: Any = type("ConnectionError", (Exception,), {"__module__": "requests.exceptions"})
    child = type("ProxyError", (base,), {"__module__": "myapp"})
    assert FailureClassifier().classify(child()) is FailureClass.CONNECTION


def test_the_rules_in_their_order() -> None:
    class Quota(Exception):
        pass

    class Declared(Quota):
        failure_class = FailureClass.AUTH

    classifier = FailureClassifier({Quota: FailureClass.RATE_LIMIT})
    # 1. the exception's own attribute, 2. a registered type (and subclasses),
    # 3. built-in knowledge, 4. unknown.
    assert classifier.classify(Declared()) is FailureClass.AUTH
    assert classifier.classify(type("Sub", (Quota,), {})()) is FailureClass.RATE_LIMIT
    classifier.register(ConnectionError, "server_error")
    assert classifier.classify(ConnectionRefusedError()) is FailureClass.SERVER_ERROR
    assert classifier.classify(LookupError()) is FailureClass.UNKNOWN
    # The nearest registered class in the MRO wins.
    classifier.register(OSError, "auth")
    assert classifier.classify(ConnectionRefusedError()) is FailureClass.SERVER_ERROR
    assert classifier.classify(FileNotFoundError()) is FailureClass.AUTH


def test_a_declared_class_that_is_not_one_is_unknown() -> None:
    class Odd(ConnectionError):
        failure_class = "sometimes"

    class Upper(Exception):
        failure_class = "RATE_LIMIT"

    class Raising(ConnectionError):
        @property
        def failure_class(self) -> str:
            raise RuntimeError("no")

    classifier = FailureClassifier()
    assert classifier.classify(Odd()) is FailureClass.UNKNOWN
    assert classifier.classify(Upper()) is FailureClass.RATE_LIMIT
    # An attribute that raises is no declaration: the rules go on.
    assert classifier.classify(Raising()) is FailureClass.CONNECTION


def test_wrappers_are_unwrapped_to_the_error_that_decided() -> None:
    classifier = FailureClassifier()
    error: BaseException = TimeoutError()
    for depth in range(8):
        error = Reject(error, requeue=False) if depth % 2 else NoSideEffect(error)
    assert classifier.classify(error) is FailureClass.CONNECTION
    # A subclass of NoSideEffect is an error of its own, not a wrapper.

    class Refused(NoSideEffect):
        failure_class = "client_error"

    assert classifier.classify(Refused(TimeoutError())) is FailureClass.CLIENT_ERROR
    assert classifier.classify(NoSideEffect("no error inside")) is FailureClass.UNKNOWN
    # The wrapper's own declaration comes first.
    declared = NoSideEffect(TimeoutError())
    declared.failure_class = "auth"  # type: ignore[attr-defined]
    assert classifier.classify(declared) is FailureClass.AUTH


def test_no_side_effect_is_said_by_the_class_or_an_attribute_set_to_true() -> None:
    assert is_no_side_effect(NoSideEffect())
    marked = ValueError()
    marked.no_side_effect = True  # type: ignore[attr-defined]
    assert is_no_side_effect(marked)
    truthy = ValueError()
    truthy.no_side_effect = "yes"  # type: ignore[attr-defined]
    assert not is_no_side_effect(truthy)  # only True itself says it
    assert not is_no_side_effect(ValueError())
    wrapped = NoSideEffect(ConnectionError("x"))
    assert isinstance(wrapped.error, ConnectionError) and "x" in str(wrapped)


def test_the_setting_names_exceptions_and_classes_it_knows() -> None:
    classifier = FailureClassifier.from_setting({"builtins.KeyError": "RATE_LIMIT",
                                                 "builtins.ArithmeticError": "auth"})
    assert classifier.classify(KeyError()) is FailureClass.RATE_LIMIT
    assert classifier.classify(ZeroDivisionError()) is FailureClass.AUTH
    with pytest.raises(ValueError, match="not a failure class: 'sometimes'"):
        FailureClassifier.from_setting({"builtins.KeyError": "sometimes"})
    assert FailureClassifier.from_setting(None).classify(KeyError()) is FailureClass.UNKNOWN
