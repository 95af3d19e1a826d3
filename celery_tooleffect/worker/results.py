"""Celery's result, stored by the write's own outcome script.

When the result backend is Celery's Redis backend on the same server as the
store, as the same user (the common deployments: one Redis, or one Redis with
results and store in a database apart from the broker's), or its Sentinel
backend naming the same master through the same Sentinels, a write's result is
stored inside the script that records its outcome, in exactly the key, format,
expiry and PUBLISH of ``RedisBackend`` (``celery/backends/redis.py``:
``_store_result`` builds the meta with ``_get_result_meta``, encodes it, and
``_set`` SETs it with ``result_expires`` and PUBLISHes it on the key, which
``AsyncResult.get()`` waits on; in the backend's database, which the script
selects when it is not the store's). The task's request then says
``ignore_result``, which ``Backend.mark_as_done`` reads to skip its own store
while it still tells a chord the part returned (``on_chord_part_return``).

Two gains: the outcome and the result are recorded together or not at all (a
worker killed between them no longer leaves a task whose journal says
``succeeded`` and whose result never arrives), and the two result-backend
round trips of Celery's store (the GET of the current state, then SET and
PUBLISH) are saved. Anything else (another backend, another server, a Redis
Cluster store, ``ignore_result``, interactive runs) is left to Celery.
"""

from __future__ import annotations

import logging
import weakref
from traceback import format_exception
from typing import Any

from celery import states as celery_states
from celery.app.task import get_actual_ignore_result
from celery.backends.base import DisabledBackend
from celery.exceptions import Retry

from ..endpoints import server_identity
from ..store.audit import StoredResult
from ..store.runtime import ToolRuntime

logger = logging.getLogger(__name__)

_same: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_db: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def backend_is_the_store(backend: Any, runtime: ToolRuntime) -> bool:
    """Whether ``backend`` is Celery's Redis (or Sentinel) backend on the store's
    server (or master), as the same user, in the store's database or another
    one (:func:`backend_db`)."""
    cached = _same.get(backend)
    if cached is not None:
        return cached
    same = False
    try:
        from celery.backends.redis import RedisBackend

        store = runtime.settings.store_endpoint
        if (isinstance(backend, RedisBackend) and not runtime.settings.redis_cluster
                and not store.cluster):
            identity = backend_identity(backend)
            same = identity is not None and _reach(identity) == store.reach()
    except Exception:
        same = False
    _same[backend] = same
    return same


def backend_db(backend: Any, runtime: ToolRuntime) -> int | None:
    """The database of a backend :func:`backend_is_the_store` accepted, when it
    is not the store's (the outcome script selects it); None when it is."""
    if backend in _db:
        return _db[backend]
    db: int | None = int(backend.connparams.get("db") or 0)
    db = None if db == runtime.settings.store_endpoint.db else db
    _db[backend] = db
    return db


def _reach(identity: tuple[Any, ...]) -> tuple[Any, ...]:
    """:func:`backend_identity` without the database, as ``RedisEndpoint.reach``."""
    return identity[:3] + identity[4:] if identity[0] == "sentinel" else identity[:2] + identity[3:]


def backend_identity(backend: Any) -> tuple[Any, ...] | None:
    """:meth:`RedisEndpoint.identity` of Celery's Redis or Sentinel result
    backend (None for a subclass of them the package does not know)."""
    params = backend.connparams
    kind = type(backend).__name__
    if kind == "RedisBackend":
        return server_identity(params)
    if kind == "SentinelBackend":
        # Celery's SentinelBackend: the Sentinels are ``hosts``, the master's
        # name its transport options' master_name, db and user the first URL's.
        sentinels = frozenset((str(host["host"]), int(host["port"])) for host in params["hosts"])
        return ("sentinel", sentinels, backend._transport_options.get("master_name"),
                int(params.get("db") or 0), params.get("username") or "default",
                params.get("password") or "")
    return None


def result_for_outcome(tool: Any, request: Any, result: Any,
                       runtime: ToolRuntime) -> StoredResult | None:
    """Celery's result record of this successful call, to be stored by the
    outcome's script; None when Celery stores it itself (see the module docs).

    Raises kombu's ``EncodeError`` when the result backend's serializer
    cannot encode ``result``, before anything is recorded, whichever backend
    stores it: Celery's tracer would raise it from ``mark_as_done`` only after
    the outcome, and the acknowledgement riding with it, were recorded, and
    report a failure outside the body (a read would then run again). For a
    backend other than the store's Redis this encodes the result once more
    than Celery does (the backends all store it with ``Backend.encode``)."""
    if request.is_eager or request.called_directly or _ignored(tool, request):
        return None
    backend = tool.backend
    if not backend_is_the_store(backend, runtime):
        check_storable(tool, request, result)
        return None
    # What Backend.store_result and BaseKeyValueStoreBackend._store_result do.
    encoded = backend.encode_result(result, celery_states.SUCCESS)
    meta = backend._get_result_meta(result=encoded, state=celery_states.SUCCESS,
                                    traceback=None, request=request)
    meta["task_id"] = str(request.id)
    value = backend.encode(meta)
    if isinstance(value, str) and len(value) > backend._MAX_STR_VALUE_SIZE:
        return None  # Celery raises its BackendStoreError
    expires = backend.expires
    return StoredResult(backend.get_key_for_task(request.id), value,
                        int(expires) if expires else None, backend_db(backend, runtime))


def check_storable(tool: Any, request: Any, result: Any) -> None:
    """Raise kombu's ``EncodeError`` if Celery's result backend cannot encode
    ``result`` as it stores a success (every backend encodes it with
    ``Backend.encode``); nothing for a result Celery does not store."""
    if request.is_eager or request.called_directly or _ignored(tool, request):
        return
    backend = tool.backend
    if not isinstance(backend, DisabledBackend):
        backend.encode(backend.encode_result(result, celery_states.SUCCESS))


def store_retry_first(tool: Any, request: Any, raised: BaseException) -> bool:
    """Store Celery's RETRY state of this call now, before its retry can run.

    Celery publishes a retry (``Task.retry``) before its tracer stores RETRY
    (``TraceInfo.handle_retry``), and ``_store_result``'s guard against
    overwriting a SUCCESS is a GET then a SET: a retry whose countdown is
    near 0 (``retry_jitter``) can run and store its SUCCESS between them, and
    the call's state then stays RETRY although it succeeded. Stored here,
    before the retry is published and before the journal lets another
    delivery begin, RETRY always comes first. True when stored; the caller
    then tells the tracer (:func:`stored_by_the_outcome`) once the retry is
    published, so that the retry's own options do not carry ``ignore_result``.
    False (Celery stores it, as always) for a result Celery would not store,
    or when the store failed (logged). ``raised``: Celery's ``Retry`` (its
    ``exc`` is stored, as the tracer stores it) or the failure retried."""
    if request.is_eager or request.called_directly or _ignored(tool, request):
        return False
    exc = raised.exc if isinstance(raised, Retry) else raised
    traceback = "".join(format_exception(type(raised), raised, raised.__traceback__))
    try:
        tool.backend.mark_as_retry(request.id, exc, traceback, request=request)
    except Exception as failed:
        logger.warning("RETRY state of %s[%s] not stored before its retry (%s: %s); "
                       "Celery's tracer stores it", tool.name, request.id,
                       type(failed).__name__, failed)
        return False
    return True


def stored_by_the_outcome(request: Any) -> None:
    """Tell Celery's tracer that the result is stored: ``mark_as_done`` reads
    ``request.ignore_result`` and skips its store (the chord is still told),
    and so does ``handle_retry`` (through ``handle_error_state``)."""
    request.ignore_result = True


def _ignored(tool: Any, request: Any) -> bool:
    return bool(get_actual_ignore_result(tool, request))
