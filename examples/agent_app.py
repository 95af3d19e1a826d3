"""Example agent tools as a Celery app for a real worker.

    REDIS_URL=redis://127.0.0.1:6379/0 celery -A examples.agent_app worker --loglevel INFO
    celery -A examples.agent_app flower          # with the `flower` extra installed

The broker, result backend and audit store are all the Redis at ``$REDIS_URL``
(default ``redis://127.0.0.1:6379/0``); ``docker compose up`` runs exactly
this. With ``$BROKER_URL`` set (``amqp://...``: RabbitMQ) that is the broker,
and the rest stays on Redis (``docker-compose.rabbitmq.yml``). Three tools are
those of ``python -m celery_tooleffect.demo`` (defined again here: the example
does not depend on the demo), without the one that breaks the audit store on
purpose. Call them from a Python shell::

    >>> from examples.agent_app import send_invoice
    >>> send_invoice.delay("cust-42", 1999).get(timeout=10)
    'INV-0001'

Two more tools fail on purpose, so that there are dead letters to look at
(``python -m examples.produce`` calls them; ``docker compose up`` runs it):

- ``sync_crm_contact`` (IDEMPOTENT_WRITE) fails the first time for a customer
  with an expired CRM token (class ``auth``, never retried): dead-lettered.
  Replaying it from the Dead letters page succeeds (the token is "refreshed").
- ``charge_card`` (NON_IDEMPOTENT_WRITE) declines any amount above 1000.00
  (class ``client_error``): dead-lettered; the page replays it only with a
  confirmation and a reason. It passes its ``idempotency_key`` to the provider
  stand-in and declares ``reconcile``: a charge interrupted by a killed worker
  is settled by asking the provider, not dead-lettered.

And one waits for a person: ``refund_order`` (IDEMPOTENT_WRITE) needs an
approval for refunds above 100.00; such a call is parked until someone
approves or rejects it (``celery -A examples.agent_app tooleffect approvals
list``, or Flower's Approvals page).
"""

from __future__ import annotations

import json
import os

import redis
from celery import Celery

from celery_tooleffect import Reconciliation, ToolEffect, ToolTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
BROKER_URL = os.environ.get("BROKER_URL") or REDIS_URL

app = Celery("agent_app", broker=BROKER_URL, backend=REDIS_URL)
app.conf.update(
    # The journal, audit and (on RabbitMQ) the dead letters live here.
    tooleffect_redis_url=REDIS_URL,
    broker_connection_retry_on_startup=True,
    task_default_queue="agent-tools",
    worker_prefetch_multiplier=1,
    # Flower shows the tasks' events.
    worker_send_task_events=True,
    task_send_sent_event=True,
)

#: What ``search_catalog`` searches.
CATALOG = (
    "usb-c cable 1m",
    "usb-c cable 2m",
    "hdmi cable 2m",
    "usb hub 4 ports",
    "laptop stand",
)


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


@app.task(base=ToolTask, name="agent.search_catalog")  # undeclared: READ_ONLY
def search_catalog(query: str) -> list[str]:
    """Look items up in the catalog. Changes nothing."""
    return [item for item in CATALOG if query.lower() in item]


# The writes' operation_deadline is what their bodies need (a call to a
# provider: seconds), with a margin, not a generous upper bound: it is also
# how long a write's message stays leased to a worker that was killed while
# running it: the message is redelivered (and the write run again, reconciled
# or dead-lettered) only when that lease ends, up to the deadline after the
# attempt started. A deadline of minutes leaves an interrupted call waiting
# for minutes (and a crash test of it as long: examples/test_agent_app.py).
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


class CrmTokenExpired(Exception):
    """The CRM refused the call: its token expired (not worth retrying as is)."""

    failure_class = "auth"


class CardDeclined(Exception):
    """The payment provider declined the charge."""

    failure_class = "client_error"


@app.task(
    base=ToolTask, name="agent.sync_crm_contact", effect=ToolEffect.IDEMPOTENT_WRITE,
    operation_deadline=10,
)
def sync_crm_contact(customer_id: str, email: str) -> str:
    """Write a contact to the CRM; the first call per customer meets an expired token."""
    client, prefix = world(app)
    if client.incr(f"{prefix}crm_calls:{customer_id}") == 1:
        raise CrmTokenExpired(f"CRM token expired while syncing {customer_id}")
    client.hset(f"{prefix}crm:{customer_id}", "email", email)
    return email


def find_charge(self: ToolTask, customer_id: str, amount_cents: int) -> Reconciliation:
    """After an interrupted charge: ask the provider whether it holds one under
    this call's idempotency key."""
    client, prefix = world(app)
    charge = client.hget(f"{prefix}provider:charges", self.idempotency_key)
    if charge is None:
        return Reconciliation.not_applied(evidence="the provider has no charge under the key")
    return Reconciliation.applied(charge.decode(), evidence=f"provider charge {charge.decode()}")


@app.task(
    base=ToolTask, bind=True, name="agent.charge_card",
    effect=ToolEffect.NON_IDEMPOTENT_WRITE, operation_deadline=15, reconcile=find_charge,
)
def charge_card(self: ToolTask, customer_id: str, amount_cents: int) -> str:
    """Charge a card: doing it twice charges twice, unless the provider
    deduplicates by the idempotency key (as this stand-in does, like payment
    APIs with an ``Idempotency-Key`` header). Declines amounts above 1000.00."""
    if amount_cents > 100_000:
        raise CardDeclined(f"amount {amount_cents} cents is over the card's limit")
    client, prefix = world(app)
    charge = f"ch_{self.idempotency_key[:12]}"
    if client.hsetnx(f"{prefix}provider:charges", self.idempotency_key, charge):
        client.rpush(f"{prefix}charges", f"{customer_id}:{amount_cents}")
    return charge


def large_refunds(self: ToolTask, order_id: str, amount_cents: int) -> bool:
    """The approval policy of ``refund_order``: a person approves refunds above 100.00."""
    return amount_cents > 10_000


@app.task(
    base=ToolTask, name="agent.refund_order", effect=ToolEffect.IDEMPOTENT_WRITE,
    operation_deadline=10, requires_approval=large_refunds,
)
def refund_order(order_id: str, amount_cents: int) -> str:
    """Refund an order (once per order: the refund is keyed by it)."""
    client, prefix = world(app)
    client.hset(f"{prefix}refunds", order_id, amount_cents)
    return f"refunded {amount_cents} cents on {order_id}"
