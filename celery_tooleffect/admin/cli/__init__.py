"""The operator's command line: ``celery -A app tooleffect ...``, ``celery-tooleffect -A app ...``.

The same click group is installed twice: as a Celery sub-command (entry point
group ``celery.commands``, name ``tooleffect``: :data:`tooleffect`), which gets
the app from Celery's own ``-A``, and as the console script
``celery-tooleffect`` (:func:`main`), which takes ``-A/--app`` itself.
Commands, one module each::

    dlq list [--queue Q] [--dead-letter-reason R] [--failure-class C] [--effect E]
             [--limit N] [--cursor C] [--json | --wide]
    dlq show TASK_ID [--json]
    dlq replay TASK_ID... | --all [filters]   [--force] [--reason TEXT] [--json]
    dlq purge TASK_ID... | --all --older-than DURATION [filters]  [--yes] [--reason TEXT]
    dlq reconcile TASK_ID... | --all [filters]  [--json]
    dlq stats [--json | --wide]
    approvals list [--queue Q] [--tool NAME] [--state S] [--limit N] [--offset N]
                   [--json | --wide]
    approvals show TASK_ID [--json]
    approvals approve TASK_ID... [--reason TEXT] [--by NAME] [--json]
    approvals reject TASK_ID... --reason TEXT [--by NAME] [--json]
    approvals stats [--json | --wide]
    audit show RUN_ID [--json | --wide]
    audit verify RUN_ID... | --all [--json]
    audit tail [--count N] [--follow] [--json | --wide]
    runs show RUN_ID [--cursor C] [--limit N] [--json | --wide]
    tools [--json | --wide]
    store [--sizing [--sample N] [--runs N] [--window N]] [--json | --wide]
    flower [flower options]
    mcp [--transport stdio|streamable-http] [--host H] [--port P] [--tool PATTERN]...
        [--token-env NAME]

(:mod:`.dlq`, :mod:`.approvals`, :mod:`.audit`, :mod:`.runs`, :mod:`.tools`, :mod:`.store`,
:mod:`.flower`, :mod:`.mcp`;
what they share, :mod:`.base`; the filters' choices come from the enums,
:mod:`celery_tooleffect.admin.filters`.)

Exit codes: 0 done; 1 refused, not found, or the store could not be reached
(``audit verify``: a chain broken; ``tools``: live workers disagree about a
tool's effect); 2 usage error (click's own). A store that is down or refuses, a broker that is
down, or invalid settings end any command with one line on stderr (which
store, its URL without password, and the error) and exit code 1, never a
traceback: every command is a :class:`~.base.StoreCommand`.

Human output is an aligned table no wider than the terminal (``$COLUMNS``,
else 80 columns without one: ids and tool names are never cut, less important
columns are left out first and named; ``--wide`` prints every column whole); ``--json``
output is stable and documented (a listing's JSON is the one Flower's API
answers). Who acts is ``$TOOLEFFECT_ACTOR``, else ``user@host``; it is
written in the audit event of every replay and purge, and of every approval
decision (``--by`` names someone else).

Every ``celery`` command imports this package (through the entry point). It
loads the package's admin modules, but never Flower or tornado: only the
``flower`` command imports them, when it runs; likewise only ``mcp``
imports the ``mcp`` SDK.
"""

from __future__ import annotations

import os

import click
from celery.app.utils import find_app
from celery.bin.base import CLIContext

from .approvals import approvals
from .audit import audit
from .base import ToolEffectGroup
from .dlq import dlq
from .flower import flower_command
from .mcp import mcp_command
from .runs import runs
from .store import store_command
from .tools import tools_command

__all__ = ["main", "tooleffect"]


#: What ``tooleffect --help`` (and ``celery-tooleffect --help``) says: every command.
HELP = """celery-tooleffect: dead letters (dlq), calls awaiting approval (approvals),
audit trails (audit), agent runs (runs), the tools workers declare (tools),
the store's durability and sizing (store), Flower with the package's pages
(flower), the MCP server (mcp)."""
SHORT_HELP = "Dead letters, approvals, audit, runs, tools, store, Flower, MCP."


@click.group(name="tooleffect", cls=ToolEffectGroup, help=HELP, short_help=SHORT_HELP)
def tooleffect() -> None:
    pass


for _command in (dlq, approvals, audit, runs, tools_command, store_command, flower_command,
                 mcp_command):
    tooleffect.add_command(_command)


@click.group(name="celery-tooleffect", commands=tooleffect.commands, help=HELP)
@click.option("-A", "--app", "app_name", required=True, metavar="APP",
              help="The Celery app (module or module:attribute), as for celery -A.")
@click.option("--workdir", type=click.Path(file_okay=False, exists=True),
              help="Change to this folder first (where the app module is found).")
@click.pass_context
def main(ctx: click.Context, app_name: str, workdir: str | None) -> None:
    if workdir:
        os.chdir(workdir)
    try:
        app = find_app(app_name)
    except Exception as exc:
        raise click.UsageError(f"cannot load the app {app_name!r}: {exc}") from exc
    ctx.obj = CLIContext(app=app, no_color=True, workdir=workdir, quiet=False)
