"""Flower 2.x with "Dead letters" and "Approvals" pages, their JSON APIs, and gauges.

``celery -A app tooleffect flower [flower options]`` starts Flower exactly as
``celery -A app flower`` does (same options, environment variables, config
file, authentication, TLS and URL prefix), plus:

- a **Dead letters** tab in Flower's navigation: the list with filters (queue,
  dead-letter reason, failure class, effect) and paging, one letter's details,
  and replay and purge buttons under the rules of
  :mod:`celery_tooleffect.admin.operations`. A
  NON_IDEMPOTENT_WRITE (or a write whose body completed) is replayed only
  when the operator ticks a confirmation and gives a reason; without them the
  page shows the refusal and nothing is published;
- the JSON API::

      GET  /api/dead-letters?queue=&dead_letter_reason=&failure_class=&effect=&limit=&cursor=
      GET  /api/dead-letters/stats
      GET  /api/dead-letters/<task_id>
      POST /api/dead-letters/<task_id>/replay   {"force": false, "reason": ""}
      POST /api/dead-letters/<task_id>/purge    {"reason": ""}
      POST /api/dead-letters/<task_id>/reconcile  {}

  with the same JSON as the CLI's ``--json`` (replay and purge answer one
  result: 200 done, 409 refused, 404 not found, 503 failed). As in the CLI,
  ``dead_letter_reason`` filters and ``reason`` is only the operator's why,
  written in the audit event of a replay or purge (a list request with a
  ``reason`` is refused with 400);
- an **Approvals** tab: the calls parked until a person approves them
  (:mod:`celery_tooleffect.admin.approvals`), with filters (queue, tool) and
  paging, one call's details, and Approve and Reject forms, each with a
  reason (a rejection needs one); and its JSON API::

      GET  /api/approvals?queue=&tool=&state=&limit=&offset=
      GET  /api/approvals/stats
      GET  /api/approvals/<task_id>
      POST /api/approvals/<task_id>/approve   {"reason": ""}
      POST /api/approvals/<task_id>/reject    {"reason": "..."}

  (a decision answers one result, with the status codes of a replay);
- gauges on Flower's ``/metrics``, read from the store at each scrape
  (:class:`StoreGauges`): ``tooleffect_approvals_pending{queue,tool}``, the
  calls awaiting a decision; ``tooleffect_dead_letters{queue,reason,
  failure_class,effect}``, the dead letters of each combination; and
  ``tooleffect_oldest_dead_letter_age_seconds{queue}``, how long the oldest
  dead letter of each queue has waited; ``tooleffect_store_evicted_keys{store}``
  and ``tooleffect_store_maxmemory_policy_evicting{store}`` (``store``:
  ``journal`` or ``dead_letters``), what ``INFO`` says of evictions (no sample
  when the store does not answer: absent, never 0);
- a "Failure class" row on Flower's task page for failed tool tasks (from
  the ``failure_class`` field the worker adds to ``task-failed``).

Authentication is Flower's own: the pages subclass Flower's ``BaseHandler``
and the API its ``BaseApiHandler``, and every method is ``@web.authenticated``.
So ``--basic-auth`` and ``--auth`` (OAuth) protect the page and its actions,
and the API answers only when authentication is configured or
``FLOWER_UNAUTHENTICATED_API`` is set, as Flower's own API does.

Cross-site request forgery is NOT left to Flower: a browser that has cached
the operator's basic-auth credentials sends them with a form that another
site submits, and Flower's ``check_xsrf_cookie`` does not stop it. Flower
2.0 never turns tornado's ``xsrf_cookies`` setting on, so tornado checks no
POST at all; Flower 2.2 turns it on but overrides ``check_xsrf_cookie`` to
check no token under ``--basic-auth`` (only the ``Sec-Fetch-Site`` and
``Origin`` headers) and nothing at all without authentication. So the
replay, purge, approve and reject handlers check for themselves, whatever
Flower's settings, after authentication and before anything is looked up or
changed (the rules below, for the approvals' URLs as for the dead letters'):

- every replay and purge POST (page and API) from a browser must come from
  Flower's own origin: ``Sec-Fetch-Site`` must be ``same-origin`` (or
  ``none``), or, when a browser sends no ``Sec-Fetch-Site``, its ``Origin``
  must name the request's ``Host``; otherwise 403. (Behind a reverse proxy,
  pass the original ``Host`` on.) Clients that send neither header are not
  browsers, and are not what forgery abuses;
- the page's forms (``POST /dead-letters/<task_id>/(replay|purge)``) must
  carry a valid ``_xsrf`` token: tornado's own ``check_xsrf_cookie`` (the
  ``_xsrf`` form field, or an ``X-XSRFToken`` header, must match the ``_xsrf``
  cookie set when the page is rendered; the forms carry the field through
  ``xsrf_form_html()``); otherwise 403;
- the API's replay and purge take a JSON body only, sent with
  ``Content-Type: application/json`` (an empty body means the defaults),
  which an HTML form cannot send and a cross-origin script can send only
  after a CORS preflight: any other content type (form-encoded, multipart,
  ``text/plain``, none) is refused with 415, and a body that is not a JSON
  object with 400.

Who acted (the authenticated user, else ``anonymous``, and the client address)
is written in the audit event of every replay, purge, approval and rejection.

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
import atexit
import base64
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import prometheus_client
import tornado.template
from flower import command as flower_command
from flower.api import BaseApiHandler
from flower.app import Flower, rewrite_handler
from flower.options import options as flower_options
from flower.urls import settings as flower_settings
from flower.views import BaseHandler
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from tornado import web
from tornado.web import url

from ..admin.approvals import Approvals
from ..admin.operations import (
    BOTH_STORES,
    STORE,
    ActionResult,
    DeadLetterOperations,
    Outcome,
    explain,
    letter_summary,
    store_problem,
)
from ..effect import ToolEffect
from ..failures import FailureClass
from ..store.approvals import Approval
from ..store.dead_letters import Cursor, DeadLetterQuery, DeadLetterReason, DeadLetters
from ..store.states import ApprovalState
from ..worker.eviction import role_readings, servers_of

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Letters per page on the Dead letters page (``?limit=`` changes it, up to 500).
PAGE_SIZE = 25
MAX_PAGE = 500
NAV_ITEM = """
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'dead_letters' %} active{% end %}"
            href="{{ reverse_url('dead_letters') }}" id="nav-dead-letters"
            {% if active_tab == 'dead_letters' %}aria-current="page"{% end %}>Dead letters</a>
        </li>
        <li class="nav-item">
          <a class="nav-link{% if active_tab == 'approvals' %} active{% end %}"
            href="{{ reverse_url('approvals') }}" id="nav-approvals"
            {% if active_tab == 'approvals' %}aria-current="page"{% end %}>Approvals</a>
        </li>
"""
#: Parked calls per page on the Approvals page (``?limit=`` changes it, up to 500).
APPROVALS_PAGE_SIZE = 50
#: The gauges on Flower's ``/metrics`` (:class:`StoreGauges`).
APPROVALS_GAUGE = "tooleffect_approvals_pending"
DEAD_LETTERS_GAUGE = "tooleffect_dead_letters"
OLDEST_DEAD_LETTER_GAUGE = "tooleffect_oldest_dead_letter_age_seconds"
EVICTED_KEYS_GAUGE = "tooleffect_store_evicted_keys"
EVICTING_POLICY_GAUGE = "tooleffect_store_maxmemory_policy_evicting"
#: The only media type the API's replay and purge accept (an HTML form cannot send it).
JSON_MEDIA_TYPE = "application/json"
HTTP_STATUS = {Outcome.DONE: 200, Outcome.REFUSED: 409, Outcome.NOT_FOUND: 404,
               Outcome.FAILED: 503}


# -- starting Flower ---------------------------------------------------------------


def run_flower(capp: Any, argv: list[str], *, quiet: bool = False) -> None:
    """Start Flower for ``capp`` with ``argv`` (Flower's options), as ``celery flower`` does."""
    flower_command.apply_env_options()
    flower_command.apply_options(sys.argv[0], argv)
    flower_command.extract_settings()
    flower_command.setup_logging()
    flower_app = make_flower(capp, flower_options, flower_settings)
    atexit.register(flower_app.stop)
    signal.signal(signal.SIGTERM, flower_command.sigterm_handler)
    port = flower_app.start_http_server()
    if not quiet:
        flower_command.print_banner(capp, "ssl_options" in flower_settings, port)
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        flower_app.start()


def make_flower(capp: Any, options: Any, settings: dict[str, Any]) -> Any:
    """A Flower application with the Dead letters and Approvals pages, their APIs, the
    store's gauges on ``/metrics`` and the failure class row."""
    settings = dict(settings)
    settings["template_loader"] = TemplateLoader(
        str(settings["template_path"]), autoescape="xhtml_escape"
    )
    flower_app = Flower(capp=capp, options=options, **settings)
    flower_app.tooleffect_operations = DeadLetterOperations(capp)
    flower_app.tooleffect_approvals = Approvals(capp)
    handlers: list[Any] = dead_letter_handlers() + approval_handlers()
    if options.url_prefix:
        handlers = [rewrite_handler(handler, options.url_prefix) for handler in handlers]
    # Before Flower's catch-all 404 handler (tornado inserts new hosts' rules first).
    flower_app.add_handlers(r".*", handlers)
    show_failure_class(flower_app)
    export_store_gauges(flower_app.tooleffect_approvals,
                        flower_app.tooleffect_operations.runtime.dead_letters)
    return flower_app


def dead_letter_handlers() -> list[Any]:
    """The page's and the API's URL rules (without Flower's URL prefix)."""
    return [
        url(r"/dead-letters", DeadLettersPage, name="dead_letters"),
        url(r"/dead-letters/([^/]+)", DeadLetterPage, name="dead_letter"),
        url(r"/dead-letters/([^/]+)/(replay|purge|reconcile)", DeadLetterActionPage,
            name="dead_letter_action"),
        (r"/api/dead-letters", DeadLettersApi),
        (r"/api/dead-letters/stats", DeadLetterStatsApi),
        (r"/api/dead-letters/([^/]+)", DeadLetterApi),
        (r"/api/dead-letters/([^/]+)/(replay|purge|reconcile)", DeadLetterActionApi),
    ]


def approval_handlers() -> list[Any]:
    """The Approvals page's and API's URL rules (without Flower's URL prefix)."""
    return [
        url(r"/approvals", ApprovalsPage, name="approvals"),
        url(r"/approvals/([^/]+)", ApprovalPage, name="approval"),
        url(r"/approvals/([^/]+)/(approve|reject)", ApprovalActionPage,
            name="approval_action"),
        (r"/api/approvals", ApprovalsApi),
        (r"/api/approvals/stats", ApprovalStatsApi),
        (r"/api/approvals/([^/]+)", ApprovalApi),
        (r"/api/approvals/([^/]+)/(approve|reject)", ApprovalActionApi),
    ]


class TemplateLoader(tornado.template.Loader):
    """Flower's templates, plus this package's, with Dead letters and Approvals
    items in the navbar.

    The navigation items are inserted into Flower's own ``navbar.html`` when it
    is loaded (before the end of its first list), so every Flower page shows
    it without copying Flower's template.
    """

    def __init__(self, root_directory: str, **kwargs: Any) -> None:
        super().__init__(root_directory, **kwargs)
        self.own = resources.files("celery_tooleffect.admin") / "flower_templates"

    def _create_template(self, name: str) -> tornado.template.Template:
        own = self.own / name
        if own.is_file():
            source = own.read_text(encoding="utf-8")
        elif name == "navbar.html":
            with open(os.path.join(self.root, name), encoding="utf-8") as handle:
                source = with_nav_item(handle.read())
        else:
            return super()._create_template(name)
        return tornado.template.Template(source, name=name, loader=self)


def with_nav_item(navbar: str) -> str:
    """Flower's navbar template with the Dead letters and Approvals items at the end
    of its first list."""
    end = navbar.find("</ul>")
    if end < 0:
        logger.warning("Flower's navbar has no list: the Dead letters and Approvals tabs "
                       "are not shown")
        return navbar
    return navbar[:end] + NAV_ITEM + navbar[end:]


#: The fields the worker adds to a tool's ``task-failed`` event, shown on
#: Flower's task page: the failure class, and the dead-letter reason when the
#: call became a dead letter (its exception is then the tool's own error).
FAILED_EVENT_FIELDS = ("failure_class", "dead_letter_reason")


def show_failure_class(flower_app: Any) -> None:
    """Show a failed tool task's ``failure_class`` (and ``dead_letter_reason``)
    on Flower's task page.

    Flower's task page lists the fields in ``Task._fields`` only, and it
    formats a copy of the task made from those fields (``copy.copy`` goes
    through ``Task.__reduce__``), so the extra fields the worker sends with
    ``task-failed`` are kept in Flower's state but never shown. This wraps
    Flower's ``format_task`` option (keeping a user's own) so that the copy
    gets them back from the state and lists them.
    """
    options = flower_app.options
    user_format: Callable[[Any], Any] | None = options.format_task

    def format_task(task: Any) -> Any:
        if user_format is not None:
            task = user_format(task)
        fields = getattr(task, "_fields", None)
        uuid = getattr(task, "uuid", None)
        if fields is None or uuid is None:
            return task
        original = flower_app.events.state.tasks.get(uuid)
        for name in FAILED_EVENT_FIELDS:
            value = getattr(original, name, None)
            if value and name not in fields:
                setattr(task, name, value)
                fields = (*fields, name)
        task._fields = fields
        return task

    options.format_task = format_task


# -- shared by the page and the API ---------------------------------------------------


class _ToolEffectMixin:
    """What every page and API handler here shares: who is acting, the request
    checks of a state-changing POST, and running blocking calls off the loop."""

    application: Any
    request: Any
    current_user: Any

    def actor(self) -> str:
        user = self.current_user
        name = user if isinstance(user, str) and user else ""
        if not name and self.application.options.basic_auth:
            name = _basic_auth_user(self.request.headers.get("Authorization", ""))
        return f"{name or 'anonymous'} (flower {self.request.remote_ip})"

    def refuse_cross_origin(self) -> None:
        """403 for a request that a browser says comes from another origin."""
        error = cross_origin_error(self.request.headers)
        if error is not None:
            raise web.HTTPError(403, error)

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

    def check_xsrf_token(self) -> None:
        """Tornado's own ``_xsrf`` check (403 when the token is missing or wrong).

        Called explicitly, since tornado calls ``check_xsrf_cookie`` only when
        the ``xsrf_cookies`` setting is on (Flower 2.0 leaves it off), and
        tornado's method, since Flower 2.2's override checks no token under
        ``--basic-auth``.
        """
        web.RequestHandler.check_xsrf_cookie(cast(web.RequestHandler, self))

    def json_body(self) -> dict[str, Any]:
        """The request's JSON object ({} for an empty body); 415 unless it is sent as JSON.

        Only ``Content-Type: application/json`` is accepted: an HTML form can
        send ``application/x-www-form-urlencoded``, ``multipart/form-data`` and
        ``text/plain`` (which can carry a body that looks like JSON) to any
        site, never ``application/json``.
        """
        content_type = self.request.headers.get("Content-Type", "")
        if content_type.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
            raise web.HTTPError(
                415, f"Send a JSON object with Content-Type: {JSON_MEDIA_TYPE} "
                     f"(got {content_type or 'no Content-Type'})")
        raw = self.request.body
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError as exc:  # UnicodeDecodeError included
            raise web.HTTPError(400, f"invalid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "the body must be a JSON object")
        return data


class _DeadLetterMixin(_ToolEffectMixin):
    """What the dead-letter page and API share: the operations."""

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
        values: dict[str, str | None] = {}
        for name, choice in (("dead_letter_reason", DeadLetterReason),
                             ("failure_class", FailureClass), ("effect", ToolEffect)):
            value = get(name, "") or ""
            try:
                values[name] = choice.coerce(value).value if value else None
            except ValueError as exc:
                raise web.HTTPError(400, str(exc)) from None
        return DeadLetterQuery(
            queue=get("queue", "") or None, reason=values["dead_letter_reason"],
            failure_class=values["failure_class"], effect=values["effect"],
        )


def cross_origin_error(headers: Any) -> str | None:
    """Why a state-changing request with these headers is refused as cross-origin, or None.

    Browsers send ``Sec-Fetch-Site`` (to HTTPS and loopback addresses): only
    ``same-origin`` and ``none`` (the user's own navigation) are accepted.
    Without it, a browser still sends ``Origin`` with a POST, which must then
    name the ``Host`` the request was sent to. A request with neither header
    does not come from a browser: forgery needs a browser, so it passes (to
    the token and content-type rules).
    """
    site = headers.get("Sec-Fetch-Site")
    origin = headers.get("Origin")
    if site is not None:
        if site.strip().lower() in ("same-origin", "none"):
            return None
        return f"Cross-origin request refused (Sec-Fetch-Site: {site}, Origin: {origin})"
    if origin is None:
        return None
    host = (headers.get("Host") or "").strip().lower()
    if host and urlsplit(origin.strip()).netloc.lower() == host:
        return None
    return f"Cross-origin request refused (Origin: {origin})"


def _basic_auth_user(header: str) -> str:
    try:
        scheme, credentials = header.split(None, 1)
        if scheme.lower() != "basic":
            return ""
        return base64.b64decode(credentials).decode("utf-8", "replace").split(":", 1)[0]
    except (ValueError, UnicodeError):
        return ""


_REASONS = tuple(reason.value for reason in DeadLetterReason)
_CLASSES = tuple(failure_class.value for failure_class in FailureClass)
_EFFECTS = tuple(effect.value for effect in ToolEffect)


def _cursor(value: str | None) -> Cursor | None:
    if not value:
        return None
    try:
        return Cursor.decode(value)
    except ValueError:
        raise web.HTTPError(400, f"not a cursor: {value!r}") from None


def _limit(value: Any, default: int) -> int:
    try:
        return min(max(int(value), 1), MAX_PAGE) if value not in (None, "") else default
    except (TypeError, ValueError):
        raise web.HTTPError(400, f"not a limit: {value!r}") from None


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


# -- the page ----------------------------------------------------------------------


class DeadLettersPage(_DeadLetterMixin, BaseHandler):  # type: ignore[misc]
    """``/dead-letters``: the list, with filters and paging."""

    @web.authenticated
    async def get(self) -> None:
        await self.render_list()

    async def render_list(self, result: ActionResult | None = None, status: int = 200) -> None:
        get = functools.partial(self.get_argument, escape=False)
        query = self.query_from(get)
        cursor = _cursor(get("cursor", ""))
        limit = _limit(get("limit", ""), PAGE_SIZE)
        operations = self.operations
        page = await self.blocking(operations.runtime.dead_letters.page, query, limit=limit,
                                   before=cursor)
        stats = await self.blocking(operations.stats)
        self.set_status(status)
        self.render(
            "tooleffect_dead_letters.html",
            letters=[letter_summary(letter, operations.privacy, operations.accept)
                     for letter in page.letters],
            next_cursor=page.next_cursor.encode() if page.next_cursor else "",
            paged=cursor is not None,
            total=page.total,
            stats=stats,
            query=query,
            limit=limit,
            reasons=_REASONS,
            classes=_CLASSES,
            effects=_EFFECTS,
            result=result,
        )


class _DetailPage(_DeadLetterMixin, BaseHandler):  # type: ignore[misc]
    """Renders one letter's page, with its replay and purge forms."""

    async def render_detail(
        self, task_id: str, result: ActionResult | None = None, status: int = 200
    ) -> None:
        detail = await self.blocking(self.operations.detail, task_id)
        if detail is None and result is None:
            raise web.HTTPError(404, f"No dead letter {task_id!r}")
        self.set_status(status)
        self.render(
            "tooleffect_dead_letter.html",
            task_id=task_id,
            detail=detail,
            result=result,
            pretty=_pretty,
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
        confirmed = _flag(self.get_argument("confirm", "", escape=False))
        result = await self.act(task_id, action, reason=reason, force=confirmed, via="flower")
        if result.outcome is Outcome.REFUSED and not confirmed:
            result = ActionResult(
                result.task_id, result.action, result.outcome,
                result.message + " On this page: tick the confirmation and give a reason.",
                result.name, result.effect, result.queue,
            )
        await self.render_detail(task_id, result, HTTP_STATUS[result.outcome])


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str, sort_keys=True)


# -- the API -----------------------------------------------------------------------


class DeadLettersApi(_DeadLetterMixin, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/dead-letters``: one page, as ``dlq list --json``."""

    @web.authenticated
    async def get(self) -> None:
        get = functools.partial(self.get_argument, escape=False)
        operations = self.operations
        page = await self.blocking(
            operations.runtime.dead_letters.page, self.query_from(get),
            limit=_limit(get("limit", ""), 50), before=_cursor(get("cursor", "")),
        )
        self.write({
            "dead_letters": [letter_summary(letter, operations.privacy, operations.accept)
                             for letter in page.letters],
            "next_cursor": page.next_cursor.encode() if page.next_cursor else None,
            "total": page.total,
        })


class DeadLetterStatsApi(_DeadLetterMixin, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/dead-letters/stats``: as ``dlq stats --json``."""

    @web.authenticated
    async def get(self) -> None:
        stats = await self.blocking(self.operations.stats)
        self.write(stats.to_dict())


class DeadLetterApi(_DeadLetterMixin, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/dead-letters/<task_id>``: as ``dlq show --json``."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        detail = await self.blocking(self.operations.detail, task_id)
        if detail is None:
            raise web.HTTPError(404, f"No dead letter {task_id!r}")
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.write(json.dumps(detail, default=str, ensure_ascii=False))


class DeadLetterActionApi(_DeadLetterMixin, BaseApiHandler):  # type: ignore[misc]
    """``POST /api/dead-letters/<task_id>/(replay|purge)``: one result as JSON."""

    @web.authenticated
    async def post(self, task_id: str, action: str) -> None:
        self.refuse_cross_origin()
        body = self.json_body()
        result = await self.act(task_id, action, reason=str(body.get("reason") or ""),
                                force=_flag(body.get("force", False)), via="flower-api")
        self.set_status(HTTP_STATUS[result.outcome])
        self.write(result.to_dict())


# -- approvals: shared by the page and the API -------------------------------------------


class _ApprovalMixin(_ToolEffectMixin):
    """What the Approvals page and API share: the operations and the list's filters."""

    @property
    def approvals(self) -> Approvals:
        return self.application.tooleffect_approvals  # type: ignore[no-any-return]

    def approval_filters(
        self, get: Callable[..., Any]
    ) -> tuple[str | None, str | None, ApprovalState | None]:
        """The list's filters: ``queue``, ``tool`` and ``state`` (400 for an unknown state)."""
        state = get("state", "") or ""
        try:
            wanted = ApprovalState.coerce(state) if state else None
        except ValueError as exc:
            raise web.HTTPError(400, str(exc)) from None
        return get("queue", "") or None, get("tool", "") or None, wanted

    async def decide(self, task_id: str, verb: str, reason: str) -> ActionResult:
        """Approve or reject ``task_id`` as the logged-in user, once the store answers
        (else 503, nothing decided); a rejection needs a reason."""
        await self.require(STORE)
        return await self.blocking(_decide, self.approvals, task_id, verb,
                                   by=self.actor(), reason=reason.strip())


def _decide(approvals: Approvals, task_id: str, verb: str, *, by: str,
            reason: str) -> ActionResult:
    if verb == "reject" and not reason:
        approval = approvals.get(task_id)
        if approval is None:
            return ActionResult(task_id, verb, Outcome.NOT_FOUND,
                                f"{task_id}: no call waits for approval under this id")
        return ActionResult(task_id, verb, Outcome.REFUSED,
                            f"{approval.name}[{task_id}]: a rejection needs a reason "
                            "(written in the audit log); nothing was decided",
                            approval.name, approval.effect, approval.queue)
    if verb == "approve":
        return approvals.approve(task_id, by=by, reason=reason, via="flower")
    return approvals.reject(task_id, by=by, reason=reason, via="flower")


def _offset(value: Any) -> int:
    try:
        return max(int(value), 0) if value not in (None, "") else 0
    except (TypeError, ValueError):
        raise web.HTTPError(400, f"not an offset: {value!r}") from None


def _age(seconds: float) -> str:
    """How long a call has waited, for people: ``42 s``, ``5 min``, ``3 h 5 min``, ``2 d 3 h``."""
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds} s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 3600:
        return f"{minutes} min"
    if seconds < 86400:
        return f"{hours} h {minutes % 60} min"
    return f"{days} d {hours % 24} h"


_APPROVAL_STATE_BADGES = {
    ApprovalState.PENDING: "text-bg-warning", ApprovalState.APPROVED: "text-bg-success",
    ApprovalState.REJECTED: "text-bg-danger", ApprovalState.EXPIRED: "text-bg-secondary",
    ApprovalState.ENDED: "text-bg-dark", ApprovalState.ABSENT: "text-bg-light",
}


def _state_badge(approval: Approval) -> str:
    return _APPROVAL_STATE_BADGES.get(approval.state, "text-bg-secondary")


# -- approvals: the page ----------------------------------------------------------------------


class _ApprovalPages(_ApprovalMixin, BaseHandler):  # type: ignore[misc]
    """Renders the Approvals list and one call's page."""

    async def render_list(self) -> None:
        get = functools.partial(self.get_argument, escape=False)
        queue, tool, state = self.approval_filters(get)
        limit = _limit(get("limit", ""), APPROVALS_PAGE_SIZE)
        offset = _offset(get("offset", ""))
        approvals = self.approvals
        stats = await self.blocking(approvals.stats)
        found = await self.blocking(approvals.list, queue=queue, tool=tool, state=state)
        shown = found[offset:offset + limit]
        self.render(
            "tooleffect_approvals.html",
            approvals=shown,
            total=len(found),
            offset=offset,
            limit=limit,
            next_offset=offset + limit if offset + limit < len(found) else None,
            stats=stats,
            queues=sorted(set(stats["by_queue"]) | ({queue} if queue else set())),
            tools=sorted(set(stats["by_tool"]) | ({tool} if tool else set())),
            queue=queue or "",
            tool=tool or "",
            state=state.value if state is not None else "",
            now=time.time(),
            age=_age,
            badge=_state_badge,
        )

    async def render_detail(
        self, task_id: str, result: ActionResult | None = None, status: int = 200
    ) -> None:
        approval = await self.blocking(self.approvals.get, task_id)
        if approval is None and result is None:
            raise web.HTTPError(404, f"No call waits for approval under {task_id!r}")
        events: list[dict[str, str]] = []
        if approval is not None:
            run_events = await self.blocking(self.approvals.runtime.audit.events,
                                             approval.run_id)
            events = [event for event in run_events if event.get("task_id") == task_id]
        self.set_status(status)
        self.render(
            "tooleffect_approval.html",
            task_id=task_id,
            approval=approval,
            events=events,
            result=result,
            now=time.time(),
            age=_age,
            badge=_state_badge,
            pretty=_pretty,
        )


class ApprovalsPage(_ApprovalPages):
    """``/approvals``: the parked calls, with filters and paging."""

    @web.authenticated
    async def get(self) -> None:
        await self.render_list()


class ApprovalPage(_ApprovalPages):
    """``/approvals/<task_id>``: one call, with its Approve and Reject forms."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        await self.render_detail(task_id)


class ApprovalActionPage(_ApprovalPages):
    """``POST /approvals/<task_id>/(approve|reject)`` from the page's forms."""

    @web.authenticated
    async def post(self, task_id: str, verb: str) -> None:
        self.refuse_cross_origin()
        self.check_xsrf_token()
        reason = self.get_argument("reason", "", escape=False) or ""
        result = await self.decide(task_id, verb, reason)
        await self.render_detail(task_id, result, HTTP_STATUS[result.outcome])


# -- approvals: the API -----------------------------------------------------------------------


class ApprovalsApi(_ApprovalMixin, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/approvals``: one page of the listed calls, oldest first, as
    ``approvals list --json`` (``count``: on this page) with ``next_offset`` (null on
    the last page) and ``total`` (every call the filters match)."""

    @web.authenticated
    async def get(self) -> None:
        get = functools.partial(self.get_argument, escape=False)
        queue, tool, state = self.approval_filters(get)
        limit = _limit(get("limit", ""), 50)
        offset = _offset(get("offset", ""))
        found = await self.blocking(self.approvals.list, queue=queue, tool=tool, state=state)
        shown = found[offset:offset + limit]
        self.write({
            "approvals": [approval.to_dict() for approval in shown],
            "count": len(shown),
            "next_offset": offset + limit if offset + limit < len(found) else None,
            "total": len(found),
        })


class ApprovalStatsApi(_ApprovalMixin, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/approvals/stats``: pending calls by queue and tool."""

    @web.authenticated
    async def get(self) -> None:
        self.write(await self.blocking(self.approvals.stats))


class ApprovalApi(_ApprovalMixin, BaseApiHandler):  # type: ignore[misc]
    """``GET /api/approvals/<task_id>``: the call's record, pending or decided."""

    @web.authenticated
    async def get(self, task_id: str) -> None:
        approval = await self.blocking(self.approvals.get, task_id)
        if approval is None:
            raise web.HTTPError(404, f"No call waits for approval under {task_id!r}")
        self.write(approval.to_dict())


class ApprovalActionApi(_ApprovalMixin, BaseApiHandler):  # type: ignore[misc]
    """``POST /api/approvals/<task_id>/(approve|reject)``: one result as JSON."""

    @web.authenticated
    async def post(self, task_id: str, verb: str) -> None:
        self.refuse_cross_origin()
        body = self.json_body()
        result = await self.decide(task_id, verb, str(body.get("reason") or ""))
        self.set_status(HTTP_STATUS[result.outcome])
        self.write(result.to_dict())


# -- the gauges on Flower's /metrics ----------------------------------------------------------


class StoreGauges:
    """A prometheus_client collector of the store's gauges, read at each scrape.

    - ``tooleffect_approvals_pending{queue,tool}``: from ``Approvals(app).stats()``
      (which, as every read of the approvals, also expires the calls nobody
      decided in time);
    - ``tooleffect_dead_letters{queue,reason,failure_class,effect}``: the joint
      counts, one ``HGETALL`` (:meth:`DeadLetters.counts`);
    - ``tooleffect_oldest_dead_letter_age_seconds{queue}``: now minus the
      oldest score of each queue's index, one pipelined ``ZREVRANGE -1 -1
      WITHSCORES`` per queue (:meth:`DeadLetters.oldest`);
    - ``tooleffect_store_evicted_keys{store}`` and
      ``tooleffect_store_maxmemory_policy_evicting{store}`` (1 when its
      ``maxmemory-policy`` is not ``noeviction``, whatever ``maxmemory``):
      one ``INFO`` per server, ``store`` being ``journal`` (the journal and
      audit store) or ``dead_letters`` (only with ``dead_letters``); a server
      playing both roles gives both samples (see
      :mod:`celery_tooleffect.worker.eviction`).

    No envelope is read. A label set with nothing in it has no sample. When a
    store does not answer, its gauges have no sample at all (absent, never a
    false 0) and a warning is logged; the other gauges, and the rest of
    ``/metrics``, are served all the same.
    """

    def __init__(self, approvals: Approvals, dead_letters: DeadLetters | None = None) -> None:
        self.approvals = approvals
        self.dead_letters = dead_letters

    def families(self) -> list[GaugeMetricFamily]:
        """Empty families of the gauges, in the order they are served."""
        found = [GaugeMetricFamily(
            APPROVALS_GAUGE, "Tool calls awaiting a person's approval (celery-tooleffect).",
            labels=["queue", "tool"],
        )]
        if self.dead_letters is not None:
            found += [
                GaugeMetricFamily(
                    DEAD_LETTERS_GAUGE,
                    "Dead letters by queue, dead-letter reason, failure class and effect "
                    "(celery-tooleffect).",
                    labels=["queue", "reason", "failure_class", "effect"],
                ),
                GaugeMetricFamily(
                    OLDEST_DEAD_LETTER_GAUGE,
                    "Seconds since the oldest dead letter of the queue was stored "
                    "(celery-tooleffect).",
                    labels=["queue"],
                ),
            ]
        found += [
            GaugeMetricFamily(
                EVICTED_KEYS_GAUGE,
                "Keys the store's Redis has evicted (INFO evicted_keys; celery-tooleffect).",
                labels=["store"],
            ),
            GaugeMetricFamily(
                EVICTING_POLICY_GAUGE,
                "1 when the store's maxmemory-policy can evict the package's keys "
                "(celery-tooleffect).",
                labels=["store"],
            ),
        ]
        return found

    def describe(self) -> list[Metric]:
        # Their names, without a scrape's Redis reads (registering calls this).
        return list(self.families())

    def collect(self) -> Iterator[Metric]:
        families = self.families()
        yield from self.evictions(*families[-2:])
        approvals = families[0]
        stats = _served(APPROVALS_GAUGE, self.approvals.stats)
        if stats is not None:
            for row in stats["by_queue_and_tool"]:
                approvals.add_metric([row["queue"], row["tool"]], row["pending"])
            yield approvals
        if self.dead_letters is None:
            return
        letters, oldest = families[1], families[2]
        counts = _served(DEAD_LETTERS_GAUGE, self.dead_letters.counts)
        if counts is not None:
            for count in counts:
                letters.add_metric(
                    [count.queue, count.reason, count.failure_class, count.effect], count.count
                )
            yield letters
        stored = _served(OLDEST_DEAD_LETTER_GAUGE, self.dead_letters.oldest)
        if stored is not None:
            now = time.time()
            for queue, stored_at in sorted(stored.items()):
                oldest.add_metric([queue], max(now - stored_at, 0.0))
            yield oldest

    def evictions(self, evicted: GaugeMetricFamily,
                  evicting: GaugeMetricFamily) -> Iterator[Metric]:
        """The eviction gauges of the roles whose servers answered."""
        letters = self.dead_letters.client if self.dead_letters is not None else None
        found = _served(EVICTED_KEYS_GAUGE, lambda: role_readings(
            servers_of(self.approvals.runtime.audit.client, letters)))
        if found is None:
            return
        readings, failed = found
        for role, exc in sorted(failed.items()):
            logger.warning("%s{store=%s} not served: %s: %s", EVICTED_KEYS_GAUGE, role,
                           type(exc).__name__, exc)
        for role, reading in sorted(readings.items()):
            evicted.add_metric([role], reading.evicted_keys)
            evicting.add_metric([role], 1.0 if reading.evicting else 0.0)
        if readings:
            yield evicted
            yield evicting


def _served(gauge: str, read: Callable[[], T]) -> T | None:
    """``read()``, or None (and a warning) when the store does not answer."""
    try:
        return read()
    except Exception as exc:  # the rest of /metrics is served all the same
        logger.warning("%s not served: %s: %s", gauge, type(exc).__name__, exc)
        return None


#: The collector each registry serves (a second Flower app in a process replaces the first's).
_gauges: weakref.WeakKeyDictionary[CollectorRegistry, StoreGauges] = (
    weakref.WeakKeyDictionary())


def export_store_gauges(
    approvals: Approvals, dead_letters: DeadLetters | None = None,
    registry: CollectorRegistry = prometheus_client.REGISTRY,
) -> StoreGauges:
    """Serve the store's gauges (:class:`StoreGauges`) from ``registry``: by default
    prometheus_client's own, the one Flower's ``/metrics`` writes out."""
    gauges = StoreGauges(approvals, dead_letters)
    previous = _gauges.pop(registry, None)
    if previous is not None:
        registry.unregister(previous)
    registry.register(gauges)
    _gauges[registry] = gauges
    return gauges
