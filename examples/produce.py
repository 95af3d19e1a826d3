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
   without a confirmation.

It waits for every call to end (up to ``--timeout`` seconds, so it can start
before the worker does), prints how each ended, and exits 0 when the runs
ended as described.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

from examples.agent_app import (
    app,
    charge_card,
    search_catalog,
    send_invoice,
    set_shipping_address,
    sync_crm_contact,
)

#: (tool, args, whether it is meant to end as a dead letter)
CALLS: list[tuple[Any, tuple[Any, ...], bool]] = [
    (search_catalog, ("cable",), False),
    (set_shipping_address, ("order-7", "1 Main St, Springfield"), False),
    (send_invoice, ("cust-42", 1999), False),
    (sync_crm_contact, (f"cust-{uuid.uuid4().hex[:6]}", "ada@example.com"), True),
    (charge_card, ("cust-42", 250_000), True),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the calls to end (default 300)")
    options = parser.parse_args(argv)

    run_id = f"example-run-{uuid.uuid4().hex[:8]}"
    print(f"agent run {run_id}: enqueueing {len(CALLS)} tool calls", flush=True)
    sent = [
        (tool, args, dead, tool.apply_async(args, headers={"tooleffect_run_id": run_id}))
        for tool, args, dead in CALLS
    ]
    ok = True
    for tool, args, dead, result in sent:
        result.get(timeout=options.timeout, propagate=False)
        ended = "dead letter" if result.state == "FAILURE" else result.state.lower()
        print(f"  {tool.name}{args}: {ended} ({result.id})", flush=True)
        ok = ok and (result.state == "FAILURE") == dead
    print(
        f"audit trail: celery -A examples.agent_app tooleffect audit show {run_id}\n"
        "dead letters: celery -A examples.agent_app tooleffect dlq list, or the Dead letters "
        "page of Flower (http://localhost:5555/dead-letters)",
        flush=True,
    )
    app.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
