"""The demo's agent tools as a Celery app for a real worker.

    REDIS_URL=redis://127.0.0.1:6379/0 celery -A examples.agent_app worker --loglevel INFO
    celery -A examples.agent_app flower          # with the `flower` extra installed

The broker, result backend and audit store are all the Redis at ``$REDIS_URL``
(default ``redis://127.0.0.1:6379/0``); ``docker compose up`` runs exactly
this. With ``$BROKER_URL`` set (``amqp://...``: RabbitMQ) that is the broker,
and the rest stays on Redis (``docker-compose.rabbitmq.yml``). The tools are
those of ``python -m celery_tooleffect.demo``, except the one that breaks the
audit store on purpose. Call them from a Python shell::

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
  confirmation and a reason.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_tooleffect import ToolEffect, ToolTask
from celery_tooleffect.demo import register_tools, world

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

tools = register_tools(app)
search_catalog = tools.search_catalog  # READ_ONLY
set_shipping_address = tools.set_shipping_address  # IDEMPOTENT_WRITE
send_invoice = tools.send_invoice  # NON_IDEMPOTENT_WRITE


class CrmTokenExpired(Exception):
    """The CRM refused the call: its token expired (not worth retrying as is)."""

    failure_class = "auth"


class CardDeclined(Exception):
    """The payment provider declined the charge."""

    failure_class = "client_error"


@app.task(
    base=ToolTask, name="agent.sync_crm_contact", effect=ToolEffect.IDEMPOTENT_WRITE,
    operation_deadline=60,
)
def sync_crm_contact(customer_id: str, email: str) -> str:
    """Write a contact to the CRM; the first call per customer meets an expired token."""
    client, prefix = world(app)
    if client.incr(f"{prefix}crm_calls:{customer_id}") == 1:
        raise CrmTokenExpired(f"CRM token expired while syncing {customer_id}")
    client.hset(f"{prefix}crm:{customer_id}", "email", email)
    return email


@app.task(
    base=ToolTask, name="agent.charge_card", effect=ToolEffect.NON_IDEMPOTENT_WRITE,
    operation_deadline=120,
)
def charge_card(customer_id: str, amount_cents: int) -> str:
    """Charge a card: doing it twice charges twice. Declines amounts above 1000.00."""
    if amount_cents > 100_000:
        raise CardDeclined(f"amount {amount_cents} cents is over the card's limit")
    client, prefix = world(app)
    client.rpush(f"{prefix}charges", f"{customer_id}:{amount_cents}")
    return f"charged {amount_cents} cents to {customer_id}"
