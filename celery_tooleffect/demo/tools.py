# mypy: disallow-untyped-decorators=False
# (Celery ships no type hints: @app.task is untyped, as it is in any user code.)
"""The tools of the demo and of ``examples/agent_app.py``, defined once.

A tool is registered on an app by a function here (``@app.task`` inside it),
so that the demo's app, its worker processes' app and the example's app each
get their own copy of the same definitions:

- :func:`register_tools`: ``search_catalog`` (READ_ONLY),
  ``set_shipping_address`` (IDEMPOTENT_WRITE), ``send_invoice`` and
  ``charge_card`` (NON_IDEMPOTENT_WRITE, ``charge_card`` with a
  ``reconcile``): the demo's and the example's;
- :func:`register_email_customers`: a write that waits for a person's approval
  (the demo's act 4);
- :func:`register_refund_payment`: a write whose body breaks the audit store on
  purpose (the demo's act 5), only on an app whose store is a Redis of its own.

The tools make their side effects in a stand-in of the world (:func:`world`):
keys in the broker's Redis, under the app's key prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from ..effect import ToolEffect
from ..reconciliation import Reconciliation
from ..task import ToolTask

#: What ``search_catalog`` searches.
CATALOG = (
    "usb-c cable 1m",
    "usb-c cable 2m",
    "hdmi cable 2m",
    "usb hub 4 ports",
    "laptop stand",
)

#: Who ``email_customers`` writes to.
CUSTOMERS = ("cust-7", "cust-42", "cust-99")

#: ``charge_card`` declines amounts above this (1000.00).
CARD_LIMIT_CENTS = 100_000


class CardDeclined(Exception):
    """The payment provider declined the charge (never worth retrying as is)."""

    failure_class = "client_error"


@dataclass(frozen=True)
class Tools:
    """The tools :func:`register_tools` registered on one app (Celery tasks)."""

    search_catalog: Any
    set_shipping_address: Any
    send_invoice: Any
    charge_card: Any


def world(app: Celery) -> tuple[redis.Redis, str]:
    """Where the tools keep the side effects they make: the broker's Redis, or
    the store's (``tooleffect_redis_url``) when the broker is not Redis.

    Keys go under the broker's ``global_keyprefix`` (if any) plus ``world:``.
    """
    options = app.conf.broker_transport_options or {}
    prefix = f"{options.get('global_keyprefix', '')}world:"
    url = str(app.conf.broker_url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        url = str(app.conf.get("tooleffect_redis_url"))
    return redis.Redis.from_url(url, socket_timeout=5), prefix


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def register_tools(app: Celery) -> Tools:
    """Register the four tools the demo and the example share on ``app``."""

    @app.task(base=ToolTask, name="agent.search_catalog")  # undeclared: READ_ONLY
    def search_catalog(query: str) -> list[str]:
        """Look items up in the catalog. Changes nothing."""
        return [item for item in CATALOG if query.lower() in item]

    # The writes' operation_deadline is what their bodies need (a call to a
    # provider: seconds), with a margin, not a generous upper bound: it is
    # also how long a write's message stays leased to a worker that was killed
    # while running it: the message is redelivered (and the write run again,
    # reconciled or dead-lettered) only when that lease ends, up to the
    # deadline after the attempt started. A deadline of minutes leaves an
    # interrupted call waiting for minutes (and a crash test of it as long).
    @app.task(
        base=ToolTask, name="agent.set_shipping_address",
        effect=ToolEffect.IDEMPOTENT_WRITE, operation_deadline=10,
    )
    def set_shipping_address(order_id: str, address: str) -> str:
        """Set an order's address: doing it twice leaves the same result."""
        client, prefix = world(app)
        client.hset(f"{prefix}order:{order_id}", "address", address)
        return address

    @app.task(
        base=ToolTask, name="agent.send_invoice",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=15,
    )
    def send_invoice(customer_id: str, amount_cents: int) -> str:
        """Send an invoice: doing it twice sends two."""
        client, prefix = world(app)
        number = int(client.incr(f"{prefix}invoice_seq"))
        invoice = f"INV-{number:04d}"
        client.rpush(f"{prefix}invoices", json.dumps([invoice, customer_id, amount_cents]))
        return invoice

    def find_charge(self: ToolTask, customer_id: str, amount_cents: int) -> Reconciliation:
        """After an interrupted charge: ask the provider whether it holds one
        under this call's idempotency key."""
        client, prefix = world(app)
        charge = _text(client.hget(f"{prefix}provider:charges", self.idempotency_key))
        if charge is None:
            return Reconciliation.not_applied(evidence="the provider has no charge under the key")
        return Reconciliation.applied(charge, evidence=f"provider charge {charge}")

    @app.task(
        base=ToolTask, bind=True, name="agent.charge_card",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=15, reconcile=find_charge,
    )
    def charge_card(self: ToolTask, customer_id: str, amount_cents: int) -> str:
        """Charge a card: doing it twice charges twice, unless the provider
        deduplicates by the idempotency key (as this stand-in does, like payment
        APIs with an ``Idempotency-Key`` header). Declines amounts above 1000.00.

        The stand-in counts the requests it receives (``provider:requests``)
        and lists the charges it made (``charges``)."""
        if amount_cents > CARD_LIMIT_CENTS:
            raise CardDeclined(f"amount {amount_cents} cents is over the card's limit")
        client, prefix = world(app)
        client.incr(f"{prefix}provider:requests")
        charge = f"ch_{self.idempotency_key[:12]}"
        if client.hsetnx(f"{prefix}provider:charges", self.idempotency_key, charge):
            client.rpush(f"{prefix}charges", f"{customer_id}:{amount_cents}")
        return charge

    return Tools(search_catalog, set_shipping_address, send_invoice, charge_card)


def register_email_customers(app: Celery) -> Any:
    """Register ``email_customers`` on ``app``: a NON_IDEMPOTENT_WRITE that a
    person approves before each call runs (``requires_approval=True``)."""

    @app.task(
        base=ToolTask, name="agent.email_customers",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=120,
        requires_approval=True,
    )
    def email_customers(subject: str) -> str:
        """Email every customer: a person approves each call before it runs."""
        client, prefix = world(app)
        client.rpush(f"{prefix}emails", *(json.dumps([customer, subject])
                                         for customer in CUSTOMERS))
        return f"emailed {len(CUSTOMERS)} customers"

    return email_customers


def register_refund_payment(app: Celery) -> Any:
    """Register ``refund_payment`` on ``app``: a NON_IDEMPOTENT_WRITE whose body
    makes the audit store (``tooleffect_redis_url``) refuse every write.

    Raises ``ValueError`` unless that store is a Redis of its own, never the
    broker's: the body breaks it."""
    store_url = app.conf.get("tooleffect_redis_url")
    if not store_url or store_url == app.conf.broker_url:
        raise ValueError("refund_payment breaks the audit store: it needs a Redis of its own")

    @app.task(
        base=ToolTask, name="agent.refund_payment",
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=120,
    )
    def refund_payment(customer_id: str, amount_cents: int) -> str:
        """Refund a payment, then (on purpose) fill up the audit store."""
        client, prefix = world(app)
        client.rpush(f"{prefix}refunds", json.dumps([customer_id, amount_cents]))
        # The forced failure: from now on the audit store refuses every write,
        # as a Redis that reached its maxmemory does.
        store = redis.Redis.from_url(str(store_url), socket_timeout=5)
        store.config_set("maxmemory-policy", "noeviction")
        store.config_set("maxmemory", "1")
        return f"refunded {amount_cents} cents to {customer_id}"

    return refund_payment
