"""The Dead letters tab and its JSON API.

Pages: ``/dead-letters`` (the list, with filters and paging),
``/dead-letters/<task_id>`` (one letter, with its replay, purge and reconcile
forms) and ``POST /dead-letters/<task_id>/(replay|purge|reconcile)`` (the
forms). API: ``GET /api/dead-letters`` (one page, as ``dlq list --json``:
:meth:`~celery_tooleffect.admin.operations.DeadLetterOperations.listing`),
``/api/dead-letters/stats``, ``/api/dead-letters/<task_id>`` and ``POST
/api/dead-letters/<task_id>/(replay|purge|reconcile)``. The actions are
:class:`~celery_tooleffect.admin.operations.DeadLetterOperations`', under the
request checks of :mod:`.security`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from flower.api import BaseApiHandler
from flower.views import BaseHandler
from tornado import web
from tornado.web import url

from ...store.dead_letter_queries import Cursor, DeadLetterQuery
from ..filters import (
    DEAD_LETTER_REASONS,
    EFFECTS,
    FAILURE_CLASSES,
    dead_letter_query,
    parse_duration,
)
from ..operations import BOTH_STORES, ActionResult, DeadLetterOperations, Outcome
from ..visible import escape
from .handlers import HTTP_STATUS, ToolEffectHandler, flag, limit_of, pretty

#: Letters per page on the Dead letters page (``?limit=`` changes it, up to 500).
PAGE_SIZE = 25
#: Letters per page of ``GET /api/dead-letters`` (``?limit=`` changes it, up to 500).
API_PAGE_SIZE = 50


def handlers() -> list[Any]:
    """The page's and the API's URL rules (without Flower's URL prefix)."""
    return [
        url(r"/dead-letters", DeadLettersPage, name="dead_letters"),
        url(r"/dead-letters/([^/]+)", DeadLetterPage, name="dead_letter"),
        url(r"/dead-letters/([^/]+)/(replay|purge|reconcile)", DeadLetterActionPage,
            name="dead_letter_action"),
        url(r"/dead-letters-bulk/(replay|purge)", BulkPage, name="dead_letters_bulk"),
        (r"/api/dead-letters", DeadLettersApi),
        (r"/api/dead-letters/stats", DeadLetterStatsApi),
        (r"/api/dead-letters/([^/]+)", DeadLetterApi),
        (r"/api/dead-letters/([^/]+)/(replay|purge|reconcile)", DeadLetterActionApi),
        (r"/api/dead-letters-bulk/(replay|purge)", BulkApi),
    ]


class _DeadLetterHandler(ToolEffectHandler):
    """What the dead-letter page and API share: the operations and the list's filters."""

    get_argument: Callable[..., Any]

    @property
    def operations(self) -> DeadLetterOperations:
        return self.application.tooleffect_operations  # type: ignore[no-any-return]

    async def act(self, task_id: str, action: str, *, reason: str, force: bool,
                  via: str) -> ActionResult:
        """Replay, purge or reconcile ``task_id`` as the logged-in user, once both
        stores answer (else 503, nothing done)."""
        await self.require(*BOTH_STORES)
        operations = self.operations
        if action == "replay":
            return await self.blocking(operations.replay, task_id, actor=self.actor(),
                                       reason=reason, force=force, via=via)
        if action == "reconcile":
            return await self.blocking(operations.reconcile, task_id, actor=self.actor(),
                                       via=via)
        return await self.blocking(operations.purge, task_id, actor=self.actor(),
                                   reason=reason, via=via)

    def query_from(self, get: Callable[..., Any]) -> DeadLetterQuery:
        """The list's filters: ``queue``, ``dead_letter_reason``, ``failure_class``, ``effect``.

        400 for an unknown value, and for ``reason``: that is the why of a
        replay or purge, never a filter.
        """
        if get("reason", ""):
            raise web.HTTPError(
                400, "reason is the why of a replay or purge: filter by dead_letter_reason")
        try:
            return dead_letter_query(get("queue", ""), get("dead_letter_reason", ""),
                                     get("failure_class", ""), get("effect", ""))
        except ValueError as exc:
            raise web.HTTPError(400, str(exc)) from None

    async def listing(self, default_limit: int) -> tuple[DeadLetterQuery, Cursor | None, int,
                                                         dict[str, Any]]:
        """The request's filters, cursor and limit, and the page they ask for (the JSON
        of ``dlq list --json``)."""
        get = functools.partial(self.get_argument, escape=False)
        query = self.query_from(get)
        cursor = _cursor(get("cursor", ""))
        limit = limit_of(get("limit", ""), default_limit)
        found = await self.blocking(self.operations.listing, query, limit=limit, before=cursor)
        return query, cursor, limit, found


def _cursor(value: str | None) -> Cursor | None:
    if not value:
        return None
    try:
        return Cursor.decode(value)
    except ValueError:
        raise web.HTTPError(400, f"not a cursor: {value!r}") from None


# -- the page ----------------------------------------------------------------------


class DeadLettersPage(_DeadLetterHandler, BaseHandler):  # type: ignore[misc]
    """``/dead-letters``: the list, with filters and paging."""

    @web.authenticated
    async def get(self) -> None:
        await self.render_list()

    async def render_list(self, result: ActionResult | None = None, status: int = 200) -> None:
        query, cursor, limit, found = await self.listing(PAGE_SIZE)
        stats = await self.blocking(self.operations.stats)
        waiting = await self.blocking(self.operations.backlog_warnings)
        self.set_status(status)
        self.render(
            "tooleffect_dead_letters.html",
            letters=found["dead_letters"],
            next_cursor=found["next_cursor"] or "",
            paged=cursor is not None,
            total=found["total"],
            stats=stats,
            query=query,
            limit=limit,
            reasons=DEAD_LETTER_REASONS,
            classes=FAILURE_CLASSES,
            effects=EFFECTS,
            result=result,
            waiting=waiting,
        )


class _DetailPage(_DeadLetterHandler, BaseHandler):  # type: ignore[misc]
    """Renders one letter's page, with its replay and purge forms."""

    async def render_detail(
        self, task_id: str, result: ActionResult | None = None, status: int = 200
    ) -> None:
        detail = await self.blocking(self.operations.detail, task_id, page=True)
        if detail is None and result is None:
            raise web.HTTPError(404, f"No dead letter {task_id!r}")
        events: list[Any] = []
        if detail is not None:
            run_id = detail["dead_letter"]["run_id"] or task_id
            events = await self.blocking(self.operations.trail, task_id, run_id)
        self.set_status(status)
        self.render(
            "tooleffect_dead_letter.html",
            task_id=task_id,
            detail=detail,
            events=events,
            result=result,
            pretty=pretty,
            shown_text=escape,
        )


class DeadLetterPage(_DetailPage):
    """``/dead-letters/<task_id>``: one letter, with its replay and purge forms."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        await self.render_detail(task_id)


class DeadLetterActionPage(_DetailPage):
    """``POST /dead-letters/<task_id>/(replay|purge)`` from the page's forms."""

    @web.authenticated
    async def post(self, task_id: str, action: str) -> None:
        self.refuse_cross_origin()
        self.check_xsrf_token()
        reason = self.get_argument("reason", "", escape=False) or ""
        confirmed = flag(self.get_argument("confirm", "", escape=False))
        result = await self.act(task_id, action, reason=reason, force=confirmed, via="flower")
        if result.outcome is Outcome.REFUSED and not confirmed:
            result = ActionResult(
                result.task_id, result.action, result.outcome,
                result.message + " On this page: tick the confirmation and give a reason.",
                result.name, result.effect, result.queue,
            )
        await self.render_detail(task_id, result, HTTP_STATUS[result.outcome])


# -- the API -----------------------------------------------------------------------


class DeadLettersApi(_DeadLetterHandler, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/dead-letters``: one page, as ``dlq list --json``."""

    @web.authenticated
    async def get(self) -> None:
        *_, found = await self.listing(API_PAGE_SIZE)
        self.write(found)


class DeadLetterStatsApi(_DeadLetterHandler, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/dead-letters/stats``: as ``dlq stats --json``."""

    @web.authenticated
    async def get(self) -> None:
        stats = await self.blocking(self.operations.stats)
        self.write(stats.to_dict())


class DeadLetterApi(_DeadLetterHandler, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/dead-letters/<task_id>``: as ``dlq show --json``."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        detail = await self.blocking(self.operations.detail, task_id)
        if detail is None:
            raise web.HTTPError(404, f"No dead letter {task_id!r}")
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.write(json.dumps(detail, default=str, ensure_ascii=False))


class DeadLetterActionApi(_DeadLetterHandler, BaseApiHandler):  # type: ignore[misc]
    """``POST /api/dead-letters/<task_id>/(replay|purge)``: one result as JSON."""

    @web.authenticated
    async def post(self, task_id: str, action: str) -> None:
        self.refuse_cross_origin()
        body = self.json_body()
        result = await self.act(task_id, action, reason=str(body.get("reason") or ""),
                                force=flag(body.get("force", False)), via="flower-api")
        self.set_status(HTTP_STATUS[result.outcome])
        self.write(result.to_dict())


# -- bulk actions -------------------------------------------------------------------------


class _Bulk(_DeadLetterHandler):
    """What the bulk page and API share: the filters, the age of a purge, the run."""

    def older_than(self, value: Any, action: str) -> float | None:
        """A purge's ``older_than`` in seconds (``90s``, ``15m``, ``2h``, ``7d``; 0
        for every age), as ``dlq purge --all --older-than``; None for a replay."""
        if action != "purge":
            return None
        try:
            return parse_duration(str(value or "").strip() or "0s")
        except ValueError as exc:
            raise web.HTTPError(400, str(exc)) from None

    async def run_bulk(self, action: str, query: DeadLetterQuery, *, reason: str,
                       older_than: float | None, via: str) -> BulkResult:
        """Replay or purge every letter ``query`` matches, under the rules and the
        audit of the CLI's ``--all`` (NON_IDEMPOTENT_WRITEs are refused, one
        result each), once both stores answer."""
        await self.require(*BOTH_STORES)
        operations, actor = self.operations, self.actor()

        def every() -> list[ActionResult]:
            if action == "replay":
                return list(operations.replay_matching(query, actor=actor, reason=reason,
                                                       via=via))
            return list(operations.purge_matching(query, older_than=older_than or 0.0,
                                                  actor=actor, reason=reason, via=via))

        return BulkResult(action, await self.blocking(every))


class BulkResult:
    """The results of one bulk action, counted by outcome."""

    def __init__(self, action: str, results: list[ActionResult]) -> None:
        self.action = action
        self.results = results
        self.counts = {outcome.value: sum(result.outcome is outcome for result in results)
                       for outcome in Outcome}

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "counts": self.counts,
                "results": [result.to_dict() for result in self.results]}


class BulkPage(_Bulk, BaseHandler):  # type: ignore[misc]
    """``/dead-letters-bulk/(replay|purge)``: the confirmation of a bulk action on the
    letters the list's filters match (``GET``), and the action (``POST``)."""

    @web.authenticated
    async def get(self, action: str) -> None:
        get = functools.partial(self.get_argument, escape=False)
        query = self.query_from(get)
        older_than = self.older_than(get("older_than", ""), action)
        preview = await self.blocking(self.operations.bulk_preview, query,
                                      older_than=older_than)
        self.render("tooleffect_bulk.html", action=action, query=query, preview=preview,
                    older_than=get("older_than", "") or "0s", outcome=None, problem=None)

    @web.authenticated
    async def post(self, action: str) -> None:
        self.refuse_cross_origin()
        self.check_xsrf_token()
        get = functools.partial(self.get_argument, escape=False)
        query = self.query_from(_without_reason(get))
        older_than = self.older_than(get("older_than", ""), action)
        reason = (get("reason", "") or "").strip()
        if not flag(get("confirm", "")) or not reason:
            preview = await self.blocking(self.operations.bulk_preview, query,
                                          older_than=older_than)
            self.set_status(400)
            self.render("tooleffect_bulk.html", action=action, query=query, preview=preview,
                        older_than=get("older_than", "") or "0s", outcome=None,
                        problem="Tick the confirmation and give a reason: both are audited.")
            return
        outcome = await self.run_bulk(action, query, reason=reason, older_than=older_than,
                                      via="flower")
        self.render("tooleffect_bulk.html", action=action, query=query, preview=None,
                    older_than=get("older_than", "") or "0s", outcome=outcome, problem=None)


class BulkApi(_Bulk, BaseApiHandler):  # type: ignore[misc]
    """``POST /api/dead-letters-bulk/(replay|purge)``: a bulk action on the letters
    the JSON body's filters match (``queue``, ``dead_letter_reason``,
    ``failure_class``, ``effect``; a purge's ``older_than``), with a ``reason``
    (required): the results, counted by outcome."""

    @web.authenticated
    async def post(self, action: str) -> None:
        self.refuse_cross_origin()
        body = self.json_body()
        query = self.query_from(lambda name, default="": body.get(name) or default
                                if name != "reason" else "")
        reason = str(body.get("reason") or "").strip()
        if not reason:
            raise web.HTTPError(400, "a bulk action needs a reason: it is audited")
        outcome = await self.run_bulk(action, query, reason=reason,
                                      older_than=self.older_than(body.get("older_than"),
                                                                 action),
                                      via="flower-api")
        self.write(outcome.to_dict())


def _without_reason(get: Callable[..., Any]) -> Callable[..., Any]:
    """The form's fields, but ``reason`` (the why of the action, not a filter)."""
    return lambda name, default="": default if name == "reason" else get(name, default)
