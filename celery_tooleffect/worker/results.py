"""Celery's result, stored by the write's own outcome script.

When the result backend is Celery's Redis backend on the same server and
database as the store (the common deployment: one Redis), or its Sentinel
backend naming the same master through the same Sentinels, a write's result is
stored inside the script that records its outcome, in exactly the key, format,
expiry and PUBLISH of ``RedisBackend`` (``celery/backends/redis.py``:
``_store_result`` builds the meta with ``_get_result_meta``, encodes it, and
``_set`` SETs it with ``result_expires`` and PUBLISHes it on the key, which
``AsyncResult.get()`` waits on). The task's request then says
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

import weakref
from typing import Any

from celery import states as celery_states
from celery.app.task import get_actual_ignore_result
from celery.backends.base import DisabledBackend

from ..endpoints import server_identity
from ..store.audit import StoredResult
from ..store.runtime import ToolRuntime

_same: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def backend_is_the_store(backend: Any, runtime: ToolRuntime) -> bool:
    """Whether ``backend`` is Celery's Redis (or Sentinel) backend on the store's
    server (or master) and db, as the same user."""
    cached = _same.get(backend)
    if cached is not None:
        return cached
    same = False
    try:
        from celery.backends.redis import RedisBackend

        if isinstance(backend, RedisBackend) and not runtime.settings.redis_cluster:
            same = backend_identity(backend) == runtime.settings.store_endpoint.identity()
    except Exception:
        same = False
    _same[backend] = same
    return same


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
                        int(expires) if expires else None)


def check_storable(tool: Any, request: Any, result: Any) -> None:
    """Raise kombu's ``EncodeError`` if Celery's result backend cannot encode
    ``result`` as it stores a success (every backend encodes it with
    ``Backend.encode``); nothing for a result Celery does not store."""
    if request.is_eager or request.called_directly or _ignored(tool, request):
        return
    backend = tool.backend
    if not isinstance(backend, DisabledBackend):
        backend.encode(backend.encode_result(result, celery_states.SUCCESS))


def stored_by_the_outcome(request: Any) -> None:
    """Tell Celery's tracer that the result is stored: ``mark_as_done`` reads
    ``request.ignore_result`` and skips its store (the chord is still told)."""
    request.ignore_result = True


def _ignored(tool: Any, request: Any) -> bool:
    return bool(get_actual_ignore_result(tool, request))
