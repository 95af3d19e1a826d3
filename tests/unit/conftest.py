"""The service-free layer: the decision logic, in-process, in seconds.

What is here runs with no Redis, no RabbitMQ and no process of its own
(``make test-unit``): the journal's state machine, the retry policy, how a
call ends (``Execution``), envelopes, settings, URL forms, failure classes and
call identity. It stands beside the real-process tests (tests/*.py,
tests/faults/), never instead of them: a fake store can say anything, so
what the package guarantees (a write never runs twice, nothing is lost) is
proved only there, on real servers and real workers.

Nothing here may reach a server: while a test of this folder runs, a network
connection fails it (:func:`no_network`), so that a test that would need one
cannot pass here by accident, nor hang on a server that is not there.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

#: A Redis URL nothing listens on (port 1); nothing here connects to it.
NOWHERE = "redis://127.0.0.1:1/0"


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test on any connection attempt (TCP or Unix socket)."""
    attempts: list[Any] = []

    def refused(sock: socket.socket, address: Any, *_: Any) -> Any:
        attempts.append(address)
        pytest.fail(f"a service-free test tried to connect to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(socket.socket, "connect_ex", refused)
    yield
    # Also when the failure above was caught and swallowed on the way.
    assert not attempts, f"a service-free test tried to connect to {attempts!r}"


def app_with(**conf: Any) -> Celery:
    """A Celery app (never connected) with ``conf``; its broker is :data:`NOWHERE`
    unless ``conf`` names one."""
    app = Celery(f"unit-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update({"broker_url": NOWHERE, **conf})
    return app
