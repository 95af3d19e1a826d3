"""A run's page and its JSON API: every call of an agent run, in order, with a
timeline.

Page: ``/runs/<run_id>`` (``?cursor=`` pages). API: ``GET /api/runs/<run_id>``
(one page, as ``runs show --json``: :meth:`~celery_tooleffect.store.runs.RunPage.to_dict`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from flower.api import BaseApiHandler
from flower.views import BaseHandler
from tornado import web
from tornado.web import url

from ..runs import PAGE_SIZE, STATE_COLOURS, Runs, caller_label, link_of, timeline
from .handlers import ToolEffectHandler, limit_of


def handlers() -> list[Any]:
    """The run page's and API's URL rules (without Flower's URL prefix)."""
    return [
        url(r"/runs/([^/]+)", RunPage, name="run"),
        (r"/api/runs/([^/]+)", RunApi),
    ]


class _RunHandler(ToolEffectHandler):
    get_argument: Callable[..., Any]

    @property
    def runs(self) -> Runs:
        return self.application.tooleffect_runs  # type: ignore[no-any-return]

    def wanted(self) -> dict[str, Any]:
        get = functools.partial(self.get_argument, escape=False)
        return {"cursor": get("cursor", "") or None,
                "limit": limit_of(get("limit", ""), PAGE_SIZE)}


class RunPage(_RunHandler, BaseHandler):  # type: ignore[misc]
    """``/runs/<run_id>``: the run's calls in the order they started, and their timeline."""

    @web.authenticated
    async def get(self, run_id: str) -> None:
        started = time.perf_counter()
        page = await self.blocking(self.runs.page, run_id, **self.wanted())
        bars, axis_start, axis_length = timeline(page.calls)
        self.render(
            "tooleffect_run.html", run_id=run_id, page=page, bars=bars,
            axis_start=axis_start, axis_length=axis_length, colours=STATE_COLOURS,
            link_of=link_of, caller_label=caller_label, cursor=self.wanted()["cursor"],
            took_ms=(time.perf_counter() - started) * 1000,
        )


class RunApi(_RunHandler, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/runs/<run_id>``: one page of the run's calls (``runs show --json``)."""

    @web.authenticated
    async def get(self, run_id: str) -> None:
        page = await self.blocking(self.runs.page, run_id, **self.wanted())
        self.write(page.to_dict())
