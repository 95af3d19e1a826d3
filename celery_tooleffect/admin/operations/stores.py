"""Unreachable stores: the one line an operator is told when a store an action
needs is down or refuses, the broker is down, or the settings are invalid.

:func:`store_problem` PINGs the stores an action needs first, and names the
one that does not answer by its URL, without password; :func:`explain` turns
what an action raised into that line (None for any other error). The CLI
prints it (exit code 1) and Flower answers it (503).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import redis
from kombu.exceptions import OperationalError

from ...endpoints import masked_url
from ...errors import ConfigurationError, StoreUnavailable
from ...store.runtime import ToolRuntime, runtime_for

if TYPE_CHECKING:
    from celery import Celery

#: The Redis servers an operator's action may need (:func:`store_problem`): the
#: store (journal, audit log, approvals: ``tooleffect_redis_url``) and the
#: dead-letter store (the broker's Redis when the broker is Redis).
STORE = "store"
DEAD_LETTER_STORE = "dead-letter store"
BOTH_STORES = (STORE, DEAD_LETTER_STORE)
#: What a store that is down or refuses raises: the package's error, or redis-py's.
STORE_ERRORS: tuple[type[Exception], ...] = (
    StoreUnavailable, redis.RedisError, redis.exceptions.RedisClusterException,
)
#: What a broker that is down raises (kombu's wrapper, or the socket's own).
BROKER_ERRORS: tuple[type[Exception], ...] = (OperationalError, ConnectionError)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def store_problem(
    runtime: ToolRuntime, needs: Iterable[str] = BOTH_STORES,
    error: BaseException | None = None,
) -> str | None:
    """One line naming the first store of ``needs`` (:data:`STORE`,
    :data:`DEAD_LETTER_STORE`) that does not answer a PING, by its URL without
    password, and its error; None when each answers.

    With ``error`` (what an action raised) it is never None: when every store
    answers again, the line names them all, with that error.
    """
    settings = runtime.settings
    same = settings.dead_letter_url == settings.redis_url
    servers: dict[str, tuple[str, Callable[[], redis.Redis]]] = {}
    for need in needs:
        if need == STORE or same:
            servers.setdefault(settings.redis_url, (STORE, lambda: runtime.audit.client))
        else:
            servers.setdefault(settings.dead_letter_url,
                               (DEAD_LETTER_STORE, lambda: runtime.dead_letters.client))
    for url, (label, client) in servers.items():
        try:
            client().ping()
        except STORE_ERRORS as exc:
            return f"the {label} {masked_url(url)} is unavailable: {_one_line(exc)}"
    if error is None:
        return None
    named = " or ".join(f"the {label} {masked_url(url)}"
                        for url, (label, _) in servers.items())
    return f"{named or 'the store'} failed: {_one_line(error)}"


def explain(app: Celery, error: BaseException, needs: Iterable[str] = BOTH_STORES) -> str | None:
    """The one line an operator is told when ``error`` ended an action: the app's
    settings are invalid, a store of ``needs`` is down or refuses
    (:func:`store_problem`), or the broker is down; None for any other error."""
    if isinstance(error, ConfigurationError):
        return f"invalid celery-tooleffect settings: {_one_line(error)}"
    if isinstance(error, STORE_ERRORS):
        return store_problem(runtime_for(app), needs, error)
    if isinstance(error, BROKER_ERRORS):
        broker = masked_url(runtime_for(app).settings.broker_url)
        return f"the broker {broker} is unavailable: {_one_line(error)}"
    return None
