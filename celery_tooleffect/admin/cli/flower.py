"""``flower``: Flower 2.x with the Dead letters and Approvals pages
(:mod:`celery_tooleffect.admin.flower`), taking Flower's own options."""

from __future__ import annotations

import click

from .base import StoreCommand, app_of, fail


@click.command(
    "flower", cls=StoreCommand,
    short_help="Flower with Dead letters, Approvals and run pages.",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("flower_argv", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def flower_command(ctx: click.Context, flower_argv: tuple[str, ...]) -> None:
    """Start Flower 2.x with Dead letters, Approvals and run pages (takes Flower's
    own options)."""
    try:
        # Imported here, the one lazy import of the CLI: Flower, tornado and
        # prometheus_client are an optional extra, and every other command (and
        # every `celery` command, which loads this group through its entry point)
        # must start without them.
        from ..flower.app import run_flower
    except ImportError as exc:  # pragma: no cover - depends on the extra
        fail(f"Flower is not installed ({exc}): pip install 'celery-tooleffect[flower]'")
    quiet = bool(getattr(ctx.find_root().obj, "quiet", False))
    run_flower(app_of(ctx), list(flower_argv), quiet=quiet)
