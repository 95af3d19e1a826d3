"""Failure classes, and the classifier that decides which class an error is.

The class of a failure decides what happens next: a retryable class is retried
with backoff, the others are dead-lettered (queued runs) or raised
(interactive runs). First match wins:

1. an exception with a ``failure_class`` attribute;
2. a type registered by the user (``register`` or ``tooleffect_failure_classes``);
3. built-in knowledge of the standard library, redis-py, kombu, requests,
   httpx, Celery and pybreaker (optional libraries are recognised by the
   qualified names in an exception's MRO, so none of them is imported);
4. everything else: UNKNOWN, which is never retried.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping

from celery.exceptions import Reject
from kombu.utils.imports import symbol_by_name

from .choices import Choice
from .errors import NoSideEffect


class FailureClass(Choice):
    """Why a tool call failed, as far as the retry decision is concerned."""

    __choice_name__ = "a failure class"

    CONNECTION = "connection"
    RATE_LIMIT = "rate_limit"
    AUTH = "auth"
    CONFIGURATION = "configuration"
    CLIENT_ERROR = "client_error"
    SERVER_ERROR = "server_error"
    CIRCUIT_OPEN = "circuit_open"
    UNKNOWN = "unknown"

    @property
    def retryable(self) -> bool:
        """Whether trying the same call again later may succeed."""
        return self in _RETRYABLE


_RETRYABLE = frozenset(
    {
        FailureClass.CONNECTION,
        FailureClass.RATE_LIMIT,
        FailureClass.SERVER_ERROR,
        FailureClass.CIRCUIT_OPEN,
    }
)


def is_no_side_effect(exc: BaseException) -> bool:
    """Whether ``exc`` says it was raised before any side effect."""
    return isinstance(exc, NoSideEffect) or getattr(exc, "no_side_effect", False) is True


# Qualified names of exception classes from libraries that are recognised
# without being imported.
_CONNECTION_TYPES = frozenset(
    {
        "redis.exceptions.ConnectionError",
        "redis.exceptions.TimeoutError",
        "redis.exceptions.BusyLoadingError",
        "kombu.exceptions.OperationalError",
        "amqp.exceptions.ConnectionError",
        "amqp.exceptions.RecoverableConnectionError",
        "requests.exceptions.ConnectionError",
        "requests.exceptions.Timeout",
        "httpx.TransportError",
        "httpx.TimeoutException",
        "httpx.NetworkError",
        "urllib3.exceptions.ProtocolError",
        "urllib3.exceptions.NewConnectionError",
    }
)
_HTTP_STATUS_TYPES = frozenset({"requests.exceptions.HTTPError", "httpx.HTTPStatusError"})
_CIRCUIT_TYPES = frozenset({"pybreaker.CircuitBreakerError"})
_CONFIGURATION_TYPES = frozenset({"celery.exceptions.ImproperlyConfigured"})


def _qualified_names(exc_type: type) -> Iterable[str]:
    for klass in exc_type.__mro__:
        yield f"{klass.__module__}.{klass.__qualname__}"


def _class_for_status(status: int) -> FailureClass:
    if status in (401, 403):
        return FailureClass.AUTH
    if status == 429:
        return FailureClass.RATE_LIMIT
    if 500 <= status <= 599:
        return FailureClass.SERVER_ERROR
    if 400 <= status <= 499:
        return FailureClass.CLIENT_ERROR
    return FailureClass.UNKNOWN


def _http_status(exc: BaseException) -> int | None:
    try:
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
    except Exception:
        return None
    return status if isinstance(status, int) else None


class FailureClassifier:
    """Maps an exception to its :class:`FailureClass`."""

    def __init__(self, registered: Mapping[type[BaseException], FailureClass] | None = None):
        self._registered: dict[type[BaseException], FailureClass] = dict(registered or {})

    @classmethod
    def from_setting(cls, mapping: Mapping[str, str] | None) -> FailureClassifier:
        """Build from ``tooleffect_failure_classes`` ({"pkg.mod.Error": "rate_limit"})."""
        classifier = cls()
        for dotted, value in (mapping or {}).items():
            exc_type = symbol_by_name(dotted)  # type: ignore[no-untyped-call]
            if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
                raise TypeError(f"tooleffect_failure_classes: {dotted!r} is not an exception")
            classifier.register(exc_type, FailureClass.coerce(value))
        return classifier

    def register(self, exc_type: type[BaseException], failure_class: FailureClass | str) -> None:
        """Classify ``exc_type`` and its subclasses as ``failure_class``."""
        self._registered[exc_type] = FailureClass.coerce(failure_class)

    def classify(self, exc: BaseException) -> FailureClass:
        """The class of ``exc``; UNKNOWN when nothing recognises it. Never raises.

        (An exception's attributes may be properties that raise; the decision
        to retry or dead-letter must still be taken.)
        """
        try:
            return self._classify(exc)
        except Exception:
            return FailureClass.UNKNOWN

    def _classify(self, exc: BaseException) -> FailureClass:
        declared = self._declared(exc)
        if declared is not None:
            return declared
        exc = self._unwrap(exc)
        declared = self._declared(exc)
        if declared is not None:
            return declared
        for klass in type(exc).__mro__:
            if klass in self._registered:
                return self._registered[klass]
        return self._builtin(exc)

    @staticmethod
    def _declared(exc: BaseException) -> FailureClass | None:
        try:
            declared = getattr(exc, "failure_class", None)
        except Exception:
            return None
        if declared is None:
            return None
        try:
            return FailureClass.coerce(declared)
        except ValueError:
            return FailureClass.UNKNOWN

    @staticmethod
    def _unwrap(exc: BaseException) -> BaseException:
        # A dead-lettering Reject and a NoSideEffect wrapper both carry the
        # error that decided the outcome; classify that one.
        for _ in range(8):
            if isinstance(exc, Reject) and isinstance(exc.reason, BaseException):
                exc = exc.reason
            elif (
                isinstance(exc, NoSideEffect)
                and type(exc) is NoSideEffect
                and isinstance(exc.error, BaseException)
            ):
                exc = exc.error
            else:
                break
        return exc

    @staticmethod
    def _builtin(exc: BaseException) -> FailureClass:
        names = set(_qualified_names(type(exc)))
        if names & _HTTP_STATUS_TYPES:
            status = _http_status(exc)
            if status is not None:
                return _class_for_status(status)
        if names & _CIRCUIT_TYPES:
            return FailureClass.CIRCUIT_OPEN
        if names & _CONFIGURATION_TYPES:
            return FailureClass.CONFIGURATION
        if names & _CONNECTION_TYPES or isinstance(
            exc, (ConnectionError, TimeoutError, socket.gaierror, socket.herror)
        ):
            return FailureClass.CONNECTION
        return FailureClass.UNKNOWN
