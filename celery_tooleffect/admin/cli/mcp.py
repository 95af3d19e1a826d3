"""``mcp``: serve the app's tools to agents over MCP
(:mod:`celery_tooleffect.agents.mcp_server`)."""

from __future__ import annotations

import os

import click

from ...errors import ToolEffectError
from ...settings import settings_for
from .base import StoreCommand, app_of, fail


@click.command("mcp", cls=StoreCommand,
               short_help="Serve the app's tools over MCP (stdio or streamable HTTP).")
@click.option("--transport", type=click.Choice(["stdio", "streamable-http"]), default="stdio",
              show_default=True, help="stdio: one client, this process's standard streams.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="streamable-http: the address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="streamable-http: the port to listen on.")
@click.option("--tool", "patterns", multiple=True, metavar="PATTERN",
              help="Serve the tools whose name matches (fnmatch; repeatable). Default: all.")
@click.option("--token-env", metavar="NAME",
              help="streamable-http: read the bearer token from this environment variable "
                   "(default: the tooleffect_mcp_token setting).")
@click.pass_context
def mcp_command(ctx: click.Context, transport: str, host: str, port: int,
                patterns: tuple[str, ...], token_env: str | None) -> None:
    """Serve the app's tools over MCP (stdio, or streamable HTTP with a bearer token).

    Operator actions (replay, purge, approve) are never tools.
    """
    try:
        # Imported here: the mcp SDK is an optional extra, and every other
        # command (and every `celery` command) must start without it.
        from ...agents.mcp_server import ToolServer
    except ImportError as exc:  # pragma: no cover - depends on the extra
        fail(f"the mcp SDK is not installed ({exc}): pip install 'celery-tooleffect[mcp]'")
    app = app_of(ctx)
    try:
        server = ToolServer(app, patterns=patterns)
    except ToolEffectError as exc:
        fail(str(exc))
    if patterns and not server.specs:
        fail(f"no tool matches {', '.join(patterns)}")
    token = settings_for(app).mcp_token
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            fail(f"--token-env {token_env}: the variable is not set")
    try:
        server.run(transport, host=host, port=port, token=token or None)
    except ToolEffectError as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # pragma: no cover - an operator's Ctrl-C
        pass
