"""What every page and API handler of this package shares: the request checks
(:class:`~.security.RequestChecks`), blocking calls run off the event loop,
the 503 of a store that is away, and the paging parameters.

A store that is down or refuses (or a broker that is down, or invalid
settings) ends a request with 503 and one line that names the store by its
URL, without password (:func:`~celery_tooleffect.admin.operations.explain`):
``{"error": "..."}`` from the API, Flower's message page from a page; never
a 500 with a traceback. A replay, purge, reconcile, approval or rejection
PINGs the stores it needs first, so it answers that 503 before it does
anything.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from flower.api import BaseApiHandler
from tornado import web

from ..operations import BOTH_STORES, Outcome, explain, store_problem
from ..visible import visible_json
from .security import RequestChecks

T = TypeVar("T")

#: The longest page a ``?limit=`` asks for.
MAX_PAGE = 500
#: The status code of an action's result: 200 done, 409 refused, 404 not found, 503 failed.
HTTP_STATUS = {Outcome.DONE: 200, Outcome.REFUSED: 409, Outcome.NOT_FOUND: 404,
               Outcome.FAILED: 503}


class ToolEffectHandler(RequestChecks):
    """What every page and API handler here shares: who is acting, the request
    checks of a state-changing POST, and running blocking calls off the loop."""

    async def blocking(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``function`` (Redis and broker calls) off the event loop. A store that
        is down or refuses, a broker that is down, or invalid settings end the
        request: 503 with the one line of :func:`explain`."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, functools.partial(function, *args, **kwargs))
        except Exception as exc:
            problem = await loop.run_in_executor(
                None, explain, self.application.capp, exc, BOTH_STORES)
            if problem is None:
                raise
            raise web.HTTPError(503, "%s", problem) from None

    async def require(self, *needs: str) -> None:
        """503 with one line naming the store unless each store of ``needs`` answers."""
        runtime = self.application.tooleffect_operations.runtime
        problem = await self.blocking(store_problem, runtime, needs)
        if problem:
            raise web.HTTPError(503, "%s", problem)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """A 503 of :meth:`blocking` or :meth:`require` as ``{"error": "..."}`` from
        the API and as Flower's message page from a page; any other error as
        Flower writes it."""
        error = kwargs.get("exc_info", (None, None, None))[1]
        if status_code != 503 or not isinstance(error, web.HTTPError):
            cast(Any, super()).write_error(status_code, **kwargs)
        elif isinstance(self, BaseApiHandler):
            cast(Any, self).finish({"error": error.get_message()})
        else:
            cast(Any, self).render("404.html", message=error.get_message())


def limit_of(value: Any, default: int) -> int:
    """A ``?limit=`` (``default`` when absent), between 1 and :data:`MAX_PAGE`; 400
    when it is not a number."""
    try:
        return min(max(int(value), 1), MAX_PAGE) if value not in (None, "") else default
    except (TypeError, ValueError):
        raise web.HTTPError(400, f"not a limit: {value!r}") from None


def flag(value: Any) -> bool:
    """A form's or a JSON body's checkbox: true for ``1``, ``true``, ``yes``, ``on``."""
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def offset_of(value: Any) -> int:
    """A ``?offset=`` (0 when absent); 400 when it is not a number."""
    try:
        return max(int(value), 0) if value not in (None, "") else 0
    except (TypeError, ValueError):
        raise web.HTTPError(400, f"not an offset: {value!r}") from None


def pretty(value: Any) -> str:
    """``value`` as indented JSON, for a page: every invisible or text-reordering
    character escaped (``\u202e``, :func:`~celery_tooleffect.admin.visible.visible_json`)."""
    return visible_json(value, indent=2)

