"""The demo's agent tools as a Celery app for a real worker.

    REDIS_URL=redis://127.0.0.1:6379/0 celery -A examples.agent_app worker --loglevel INFO
    celery -A examples.agent_app flower          # with the `flower` extra installed

The broker, result backend and audit store are all the Redis at ``$REDIS_URL``
(default ``redis://127.0.0.1:6379/0``); ``docker compose up`` runs exactly
this. The tools are those of ``python -m celery_tooleffect.demo``, except the
one that breaks the audit store on purpose. Call them from a Python shell::

    >>> from examples.agent_app import send_invoice
    >>> send_invoice.delay("cust-42", 1999).get(timeout=10)
    'INV-0001'
"""

from __future__ import annotations

import os

from celery import Celery

from celery_tooleffect.demo import register_tools

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("agent_app", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
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
