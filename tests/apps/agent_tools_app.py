"""Tools for the agent tests (tests/agents/): the MCP server and the SDK
adapters, against real ``celery worker``s.

``build(prefix)`` makes the app; the module's ``app`` is built from the
environment when a worker or ``celery tooleffect mcp`` imports it: TE_PREFIX
(every key of the test) and TE_BROKER (default the test Redis). The
visibility timeout is 6 s, so that a write of a killed worker comes back soon;
a call parked for approval is answered as waiting after 1 s.

Each write counts its runs in ``<prefix>count:<key>``; ``send_invoice`` holds
while ``<prefix>hold:<key>`` exists (the tests kill the worker then). With
TE_UNSTORABLE_TOOL set, ``shop.tag`` is a write whose result (a ``set``) the
JSON result serializer cannot encode. TE_MCP_OAUTH (JSON) holds settings of
the MCP server's OAuth (``tooleffect_mcp_oauth_*``).

``shop.stock``, a read, fails its first attempt for each sku (counted in
``<prefix>stock:<sku>``) with a ConnectionError, which it retries after 0.2 s.
"""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, Literal

import redis
from celery import Celery
from pydantic import Field
from typing_extensions import TypedDict

from celery_tooleffect import Approver, ToolEffect, ToolTask
from tests.conftest import REDIS_URL, app_config, on_broker, spawned_setting

VISIBILITY_TIMEOUT = 6


class CardDeclined(Exception):
    """The provider declined the charge: not retried."""

    failure_class = "client_error"


class Quote(TypedDict):
    sku: str
    cents: int


def build(prefix: str, *, broker_url: str = REDIS_URL) -> Celery:
    app = Celery("agent_tools_app", set_as_current=False)
    app.conf.update(app_config(
        prefix,
        **on_broker(prefix, broker_url, visibility_timeout=VISIBILITY_TIMEOUT,
                    unacked_restore_interval=1, unacked_restore_throttle=1),
        worker_hijack_root_logger=True,
        tooleffect_agent_approval_wait=1.0,
        tooleffect_agent_result_wait=60.0,
        tooleffect_agent_max_argument_bytes=4096,
    ))
    if os.environ.get("TE_MCP_RESULT_WAIT"):  # the MCP server's wait, shortened
        app.conf.tooleffect_mcp_result_wait = float(os.environ["TE_MCP_RESULT_WAIT"])
    if os.environ.get("TE_MCP_TRUST"):  # "host|origin": what a deployment trusts
        host, origin = os.environ["TE_MCP_TRUST"].split("|")
        app.conf.update(tooleffect_mcp_allowed_hosts=[host],
                        tooleffect_mcp_allowed_origins=[origin])
    if os.environ.get("TE_MCP_OAUTH"):  # JSON: the tooleffect_mcp_oauth_* settings
        app.conf.update(json.loads(os.environ["TE_MCP_OAUTH"]))
    counters = redis.Redis.from_url(REDIS_URL)

    def count(key: str) -> int:
        return int(counters.incr(f"{prefix}count:{key}"))

    @app.task(base=ToolTask, name="shop.search", shared=False)
    def search(query: Annotated[str, Field(description="What to look for")],
               limit: int = 3) -> list[str]:
        """Search the catalog. Changes nothing."""
        return [f"{query}-{n}" for n in range(limit)]

    @app.task(base=ToolTask, name="shop.quote", shared=False)
    def quote(sku: str) -> Quote:
        """Quote a price."""
        return {"sku": sku, "cents": 1999}

    @app.task(base=ToolTask, name="shop.stock", shared=False,
              autoretry_for=(ConnectionError,), retry_kwargs={"countdown": 0.2})
    def stock(sku: str) -> int:
        """How many of an item are in stock. Changes nothing."""
        if counters.incr(f"{prefix}stock:{sku}") == 1:  # the first attempt per sku
            raise ConnectionError(f"the warehouse did not answer for {sku}")
        return 7

    @app.task(base=ToolTask, name="shop.send_invoice", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def send_invoice(key: str, cents: int) -> str:
        """Send an invoice: doing it twice sends two."""
        runs = count(key)
        deadline = time.monotonic() + 60
        while counters.exists(f"{prefix}hold:{key}") and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"INV-{key}-{runs}"

    @app.task(base=ToolTask, name="shop.charge", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE)
    def charge(key: str, cents: int) -> str:
        """Charge a card; declines more than 1000.00."""
        count(key)
        if cents > 100_000:
            raise CardDeclined(f"{cents} cents is over the card's limit")
        return f"charged {cents}"

    @app.task(base=ToolTask, name="shop.refund", shared=False,
              effect=ToolEffect.IDEMPOTENT_WRITE, requires_approval=True)
    def refund(key: str, cents: int, reason: Literal["damaged", "late"] = "late") -> str:
        """Refund an order; a person approves every refund."""
        count(key)
        return f"refunded {cents} ({reason})"

    def masked_account(self: ToolTask, key: str, account: str, cents: int) -> dict[str, str]:
        """What the person approving a wire sees: the account's last four digits."""
        return {"account": f"****{account[-4:]}", "amount": f"{cents / 100:.2f}"}

    @app.task(base=ToolTask, name="shop.wire", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=Approver.USER,
              approval_view=masked_account)
    def wire(key: str, account: str, cents: int) -> str:
        """Wire money to an account; the agent's user approves every wire."""
        runs = count(key)
        return f"wired {cents} to ****{account[-4:]} ({runs})"

    @app.task(base=ToolTask, name="shop.payout", shared=False,
              effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=Approver.BOTH)
    def payout(key: str, cents: int) -> str:
        """Pay a seller out; the agent's user, then an operator, approve it."""
        runs = count(key)
        return f"paid out {cents} ({runs})"

    if os.environ.get("TE_UNSTORABLE_TOOL"):
        @app.task(base=ToolTask, name="shop.tag", shared=False,
                  effect=ToolEffect.NON_IDEMPOTENT_WRITE)
        def tag(key: str) -> set[str]:
            """Tag an order; answers its tags as a set, which JSON cannot encode."""
            count(key)
            return {key}

    @app.task(base=ToolTask, name="shop.export", shared=False)
    def export(chars: int) -> str:
        """Export the catalog: ``chars`` characters of two UTF-8 bytes each."""
        return "\u00e9" * chars

    @app.task(name="plain.echo", shared=False)
    def echo(text: str) -> str:
        """A plain Celery task, no tool: no agent may read its result."""
        return f"plain {text}"

    if os.environ.get("TE_UNTYPED_TOOL"):
        @app.task(base=ToolTask, name="shop.untyped", shared=False)
        def untyped(key):  # type: ignore[no-untyped-def]  # what the server refuses
            return key

    return app


if os.environ.get("TE_PREFIX"):
    app = build(os.environ["TE_PREFIX"], broker_url=spawned_setting("TE_BROKER"))
