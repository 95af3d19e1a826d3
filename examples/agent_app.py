"""Example agent tools as a Celery app for a real worker.

    REDIS_URL=redis://127.0.0.1:6379/0 celery -A examples.agent_app worker --loglevel INFO
    celery -A examples.agent_app flower          # with the `flower` extra installed

The broker, result backend and audit store are all the Redis at ``$REDIS_URL``
(default ``redis://127.0.0.1:6379/0``); ``docker compose up`` runs exactly
this. With ``$BROKER_URL`` set (``amqp://...``: RabbitMQ) that is the broker,
and the rest stays on Redis (``docker-compose.rabbitmq.yml``).

Four tools are those ``python -m celery_tooleffect.demo`` calls, defined once
in the package (``celery_tooleffect.demo.tools``) and registered on this app:
``search_catalog`` (READ_ONLY), ``set_shipping_address`` (IDEMPOTENT_WRITE),
``send_invoice`` and ``charge_card`` (NON_IDEMPOTENT_WRITE). They make their
side effects in a stand-in of the world: keys in the broker's Redis (``world``).
Call them from a Python shell::

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

import os

from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from celery_tooleffect.demo.tools import register_tools, world

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

# The tools the demo (python -m celery_tooleffect.demo) calls too, defined once
# in the package: registered on this app.
tools = register_tools(app)
search_catalog = tools.search_catalog
set_shipping_address = tools.set_shipping_address
send_invoice = tools.send_invoice
charge_card = tools.charge_card


class CrmTokenExpired(Exception):
    """The CRM refused the call: its token expired (not worth retrying as is)."""

    failure_class = "auth"


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
