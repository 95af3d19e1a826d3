"""Flower with this package's pages: ``celery -A app tooleffect flower``, or
an existing ``celery flower`` whose configuration file calls :func:`install`.

:func:`run_flower` does what ``celery flower`` does, with the Flower
application of :func:`make_flower`: Flower's own, plus (:func:`extend`) the
Dead letters, Approvals and run pages and APIs (:mod:`.dead_letters`,
:mod:`.approvals`, :mod:`.runs`), their items in Flower's navbar
(:class:`TemplateLoader`), the store's gauges on ``/metrics``
(:mod:`.metrics`), and the failure class on the task page.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from importlib import resources
from typing import Any

import tornado.template
from flower import command as flower_command
from flower.app import Flower, rewrite_handler
from flower.options import options as flower_options
from flower.urls import settings as flower_settings
from flower.views import monitor as flower_monitor
from tornado import web

from ..approvals import Approvals
from ..operations import DeadLetterOperations
from ..runs import Runs
from . import approvals, dead_letters, runs
from .metrics import export_store_gauges

logger = logging.getLogger(__name__)

#: The Dead letters and Approvals items of Flower's navbar (:func:`with_nav_item`).
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
    """A Flower application with the Dead letters, Approvals and run pages, their
    APIs, the store's gauges on ``/metrics`` and the failure class row."""
    settings = dict(settings)
    settings["template_loader"] = TemplateLoader(
        str(settings["template_path"]), autoescape="xhtml_escape"
    )
    flower_app = Flower(capp=capp, options=options, **settings)
    extend(flower_app)
    return flower_app


def extend(flower_app: Any) -> None:
    """Add this package's pages, APIs, gauges and failure class row to a Flower
    application (its ``capp`` and ``options``: the URL prefix); once."""
    if hasattr(flower_app, "tooleffect_operations"):
        return
    capp, options = flower_app.capp, flower_app.options
    flower_app.tooleffect_operations = DeadLetterOperations(capp)
    flower_app.tooleffect_approvals = Approvals(capp)
    flower_app.tooleffect_runs = Runs(capp)
    handlers: list[Any] = dead_letters.handlers() + approvals.handlers() + runs.handlers()
    if flower_app.tooleffect_approvals.runtime.settings.flower_metrics_auth:
        handlers.append((r"/metrics", AuthenticatedMetrics))
    if options.url_prefix:
        handlers = [rewrite_handler(handler, options.url_prefix) for handler in handlers]
    # Before Flower's catch-all 404 handler (tornado inserts new hosts' rules first).
    flower_app.add_handlers(r".*", handlers)
    show_failure_class(flower_app)
    export_store_gauges(flower_app.tooleffect_approvals,
                        flower_app.tooleffect_operations.runtime.dead_letters)


class AuthenticatedMetrics(flower_monitor.Metrics):  # type: ignore[misc]
    """Flower's ``/metrics`` (its own series and the package's gauges), asking
    for Flower's authentication when Flower has one: under ``--basic-auth`` a
    scrape without the credentials gets 401 (``WWW-Authenticate: Basic``), under
    ``--auth`` (OAuth, a browser login no scraper has) 403. Without
    authentication configured it answers anyone, as Flower's own does. Served
    instead of Flower's unless ``tooleffect_flower_metrics_auth`` is False."""

    async def get(self) -> None:
        options = self.application.options
        if (options.basic_auth or options.auth) and not self.current_user:
            # Basic auth refused the credentials in get_current_user (401);
            # OAuth has no session for this client.
            raise web.HTTPError(401 if options.basic_auth else 403)
        await super().get()


def install() -> None:
    """Add this package's pages to the Flower that ``celery flower`` starts: call
    it from Flower's configuration file (``flowerconfig.py``, or ``--conf``),
    which Flower runs as Python before it builds its application::

        # flowerconfig.py
        from celery_tooleffect.admin.flower.app import install
        install()

    The rest of the deployment stays Flower's own: its options, authentication
    (``--basic-auth``, ``--auth`` with OAuth), TLS and ``--url_prefix``.
    Flower's templates are then loaded with the navbar items, and every
    ``Flower`` application built afterwards gets :func:`extend`. Calling it
    again changes nothing."""
    if getattr(Flower, "_tooleffect_installed", False):
        return
    flower_settings["template_loader"] = TemplateLoader(
        str(flower_settings["template_path"]), autoescape="xhtml_escape"
    )
    built = Flower.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        extend(self)

    Flower.__init__ = __init__
    Flower._tooleffect_installed = True


class TemplateLoader(tornado.template.Loader):
    """Flower's templates, plus this package's, with Dead letters and Approvals
    items in the navbar.

    The navigation items are inserted into Flower's own ``navbar.html`` when it
    is loaded (before the end of its first list), so every Flower page shows
    it without copying Flower's template.
    """

    def __init__(self, root_directory: str, **kwargs: Any) -> None:
        super().__init__(root_directory, **kwargs)
        self.own = resources.files("celery_tooleffect.admin.flower") / "templates"

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
