"""What the example agents share: the script their test models follow, a
worker of the example app (``examples/agent_app.py``) and the transcript.

Each example is an agent whose model is its framework's own test model,
following :data:`SCRIPT`: it asks for the catalog, sends an invoice and tries
a charge the card declines, then answers. No network and no API key are
needed; the tools run as Celery tasks on a real worker, on the Redis at
``$REDIS_URL`` (default ``redis://127.0.0.1:6379/0``). The example starts a
worker of its own unless ``EXAMPLE_WORKER=external`` says one runs already
(``celery -A examples.agent_app worker``).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery_tooleffect.testing import start_celery_worker

ROOT = Path(__file__).resolve().parents[2]

USER = "Find a USB-C cable, invoice customer cust-42 for it, and charge 2,500.00 to their card."

#: The tool calls the scripted model makes, in one turn: (function name,
#: arguments, tool-call id). The ids are new each run: a re-run of the same
#: ids would be the same calls, answered with their first outcome.
SCRIPT: list[tuple[str, dict[str, Any], str]] = [
    ("agent_search_catalog", {"query": "usb-c"}, f"call_{uuid.uuid4().hex[:8]}_1"),
    ("agent_send_invoice", {"customer_id": "cust-42", "amount_cents": 1999},
     f"call_{uuid.uuid4().hex[:8]}_2"),
    ("agent_charge_card", {"customer_id": "cust-42", "amount_cents": 250_000},
     f"call_{uuid.uuid4().hex[:8]}_3"),
]

FINAL = "Invoice sent; the card declined the charge, so nothing was charged."


@contextmanager
def example_worker() -> Iterator[None]:
    """A ``celery -A examples.agent_app worker`` for the example's duration."""
    if os.environ.get("EXAMPLE_WORKER") == "external":
        yield
        return
    log = Path(tempfile.mkdtemp(prefix="example-agent-")) / "worker.log"
    worker = start_celery_worker("examples.agent_app", log, queues="agent-tools",
                                 concurrency=2, name="example", root=ROOT)
    try:
        yield
    finally:
        worker.stop()


def show_call(name: str, arguments: dict[str, Any], call_id: str) -> None:
    print(f"model -> {name}({json.dumps(arguments)})  [{call_id}]")


def show_output(name: str, call_id: str, output: str, error: bool = False) -> None:
    print(f"tool  <- {name} [{call_id}]{' (error)' if error else ''}: {output}")
