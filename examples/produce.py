"""Enqueue example agent runs for the example app, one of them ending in dead letters.

    REDIS_URL=redis://127.0.0.1:6379/0 python -m examples.produce

``docker compose up`` runs this once (service ``producer``). Each run is one
agent run (the ``tooleffect_run_id`` header groups its tool calls):

1. ``search_catalog`` (READ_ONLY), ``set_shipping_address`` (IDEMPOTENT_WRITE)
   and ``send_invoice`` (NON_IDEMPOTENT_WRITE): all succeed;
2. ``sync_crm_contact`` (IDEMPOTENT_WRITE): its CRM token has expired, so it
   is dead-lettered (class ``auth``); replay it from Flower's Dead letters page;
3. ``charge_card`` (NON_IDEMPOTENT_WRITE) for too large an amount: declined,
   dead-lettered (class ``client_error``); the page refuses to replay it
   without a confirmation;
4. ``refund_order`` (IDEMPOTENT_WRITE) of 250.00: it needs a person's
   approval, so it is parked; approve or reject it from Flower's Approvals
   page or ``celery -A examples.agent_app tooleffect approvals``.

It waits for every call to end or be parked (up to ``--timeout`` seconds, so
it can start before the worker does), prints how each ended, and exits 0 when
the runs ended as described.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

from celery_tooleffect import Approvals
from examples.agent_app import (
    app,
    charge_card,
    refund_order,
    search_catalog,
    send_invoice,
    set_shipping_address,
    sync_crm_contact,
)

SUCCEEDED, DEAD_LETTER, PARKED = "success", "dead letter", "awaiting approval"

#: (tool, args, how it is meant to end)
CALLS: list[tuple[Any, tuple[Any, ...], str]] = [
    (search_catalog, ("cable",), SUCCEEDED),
    (set_shipping_address, ("order-7", "1 Main St, Springfield"), SUCCEEDED),
    (send_invoice, ("cust-42", 1999), SUCCEEDED),
    (sync_crm_contact, (f"cust-{uuid.uuid4().hex[:6]}", "ada@example.com"), DEAD_LETTER),
    (charge_card, ("cust-42", 250_000), DEAD_LETTER),
    (refund_order, ("order-7", 25_000), PARKED),
]


def ending(result: Any, expected: str, timeout: float) -> str:
    """How the call ended: parked, or (waiting for it) its result state."""
    if expected == PARKED:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if Approvals(app).get(result.id) is not None:
                return PARKED
            time.sleep(0.2)
        return result.state.lower()
    result.get(timeout=timeout, propagate=False)
    return DEAD_LETTER if result.state == "FAILURE" else result.state.lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the calls to end (default 300)")
    options = parser.parse_args(argv)

    run_id = f"example-run-{uuid.uuid4().hex[:8]}"
    print(f"agent run {run_id}: enqueueing {len(CALLS)} tool calls", flush=True)
    sent = [
        (tool, args, expected, tool.apply_async(args, headers={"tooleffect_run_id": run_id}))
        for tool, args, expected in CALLS
    ]
    ok = True
    for tool, args, expected, result in sent:
        ended = ending(result, expected, options.timeout)
        print(f"  {tool.name}{args}: {ended} ({result.id})", flush=True)
        ok = ok and ended == expected
    print(
        f"audit trail: celery -A examples.agent_app tooleffect audit show {run_id}\n"
        "dead letters: celery -A examples.agent_app tooleffect dlq list, or the Dead letters "
        "page of Flower (http://localhost:5555/dead-letters)\n"
        "approvals: celery -A examples.agent_app tooleffect approvals list, or the Approvals "
        "page of Flower (http://localhost:5555/approvals)",
        flush=True,
    )
    app.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
