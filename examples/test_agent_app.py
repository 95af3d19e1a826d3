"""The example tools (examples/agent_app.py) tested as a user tests their own
tools with the package's pytest plugin: a real worker of the app, killed with
SIGKILL at each boundary of an attempt, and a fresh worker that takes the
redelivery. Each call ends as the README's "How a task ends" table promises::

    .venv/bin/python -m pytest examples/test_agent_app.py -q \\
        --tooleffect-redis-url redis://127.0.0.1:6379/0

(without the option, the plugin starts a redis-server of its own). The writes
declare an ``operation_deadline`` of 10 or 15 s, and a killed worker's write
holds its message that long: the whole matrix takes about five minutes.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_tooleffect.demo.tools import world
from celery_tooleffect.pytest_plugin import BOUNDARIES, Ending, ToolHarness

pytest_plugins = ["celery_tooleffect.pytest_plugin"]
pytestmark = pytest.mark.tooleffect_app("examples.agent_app")

#: What charge_card returns: the charge the payment provider holds under the
#: call's idempotency key (read from the provider stand-in).
PROVIDER_CHARGE = "the provider's charge"

#: The calls, by a label: the tool, its arguments and what it returns. The
#: arguments reach the body (a refund of 50.00 needs no approval, a charge of
#: 42.00 is not declined), except the large refund's, which waits for a person.
CALLS: dict[str, tuple[str, tuple[Any, ...], Any]] = {
    "search": ("agent.search_catalog", ("usb-c",), ["usb-c cable 1m", "usb-c cable 2m"]),
    "address": ("agent.set_shipping_address", ("order-1", "1 Main St"), "1 Main St"),
    "invoice": ("agent.send_invoice", ("cust-1", 1999), "INV-0001"),
    "crm": ("agent.sync_crm_contact", ("cust-1", "ada@example.com"), "ada@example.com"),
    "charge": ("agent.charge_card", ("cust-1", 4200), PROVIDER_CHARGE),
    "refund": ("agent.refund_order", ("order-1", 5000), "refunded 5000 cents on order-1"),
    "large refund": ("agent.refund_order", ("order-2", 25_000), None),
}

APPLIED = ("reconcile", "applied")
NOT_APPLIED = ("reconcile", "not_applied")

#: (call, boundary) -> (how it ends, intents recorded, outcomes recorded, side
#: effects the world holds, a step its audit trail must show), read once the
#: redelivery was settled. Side effects: invoices sent, cards charged; for the
#: other writes 1 when the address, contact or refund is stored.
EXPECTED: dict[tuple[str, str], tuple[str, int, int, int, tuple[str, str] | None]] = {
    # READ_ONLY: run again after any crash but the last: at before_ack its
    # message was acknowledged with its audit event already (broker and store
    # share the test's Redis), so nothing is delivered again.
    ("search", "before_intent"): ("succeeded", 0, 1, 0, None),
    ("search", "after_intent"): ("succeeded", 0, 1, 0, None),
    ("search", "in_body"): ("succeeded", 0, 1, 0, None),
    ("search", "before_outcome"): ("succeeded", 0, 1, 0, None),
    ("search", "before_ack"): ("succeeded", 0, 1, 0, None),
    # IDEMPOTENT_WRITE: run again once an intent was recorded; at before_ack
    # the message was acknowledged with the outcome: nothing runs again.
    ("address", "before_intent"): ("succeeded", 1, 1, 1, None),
    ("address", "after_intent"): ("succeeded", 2, 1, 1, None),
    ("address", "in_body"): ("succeeded", 2, 1, 1, None),
    ("address", "before_outcome"): ("succeeded", 2, 1, 1, None),
    ("address", "before_ack"): ("succeeded", 1, 1, 1, None),
    ("crm", "before_intent"): ("succeeded", 1, 1, 1, None),
    ("crm", "after_intent"): ("succeeded", 2, 1, 1, None),
    ("crm", "in_body"): ("succeeded", 2, 1, 1, None),
    ("crm", "before_outcome"): ("succeeded", 2, 1, 1, None),
    ("crm", "before_ack"): ("succeeded", 1, 1, 1, None),
    ("refund", "before_intent"): ("succeeded", 1, 1, 1, None),
    ("refund", "after_intent"): ("succeeded", 2, 1, 1, None),
    ("refund", "in_body"): ("succeeded", 2, 1, 1, None),
    ("refund", "before_outcome"): ("succeeded", 2, 1, 1, None),
    ("refund", "before_ack"): ("succeeded", 1, 1, 1, None),
    # NON_IDEMPOTENT_WRITE: never run twice. Interrupted once its intent is
    # recorded, it is a dead letter, whether the invoice went out (0 or 1).
    ("invoice", "before_intent"): ("succeeded", 1, 1, 1, None),
    ("invoice", "after_intent"): ("dead_letter", 1, 0, 0, None),
    ("invoice", "in_body"): ("dead_letter", 1, 0, 0, None),
    ("invoice", "before_outcome"): ("dead_letter", 1, 0, 1, None),
    ("invoice", "before_ack"): ("succeeded", 1, 1, 1, None),
    # NON_IDEMPOTENT_WRITE with reconcile: the provider is asked instead of a
    # dead letter; charge made: its charge is the result, the body not run
    # again; not made: a new attempt charges. One charge whatever the crash.
    ("charge", "before_intent"): ("succeeded", 1, 1, 1, None),
    ("charge", "after_intent"): ("succeeded", 2, 1, 1, NOT_APPLIED),
    ("charge", "in_body"): ("succeeded", 2, 1, 1, NOT_APPLIED),
    ("charge", "before_outcome"): ("succeeded", 1, 1, 1, APPLIED),
    ("charge", "before_ack"): ("succeeded", 1, 1, 1, None),
    # Approval: parked before anything runs, so no boundary is reached.
    ("large refund", "in_body"): ("awaiting_approval", 0, 0, 0, ("approval", "requested")),
}

#: Longer than the longest deadline (15 s) plus two worker starts.
TIMEOUT = 60.0


def side_effects(tooleffect: ToolHarness, tool: str) -> int:
    """What the example's world holds after the call (under the test's prefix)."""
    client, key = world(tooleffect.app)
    if tool == "agent.search_catalog":
        return 0
    hashes = {"agent.set_shipping_address": "order:order-1",
              "agent.sync_crm_contact": "crm:cust-1", "agent.refund_order": "refunds"}
    lists = {"agent.send_invoice": "invoices", "agent.charge_card": "charges"}
    if tool in hashes:
        return int(client.hlen(key + hashes[tool]))
    return int(client.llen(key + lists[tool]))


def provider_charges(tooleffect: ToolHarness) -> list[str]:
    """The charges the payment provider stand-in holds, by idempotency key."""
    client, key = world(tooleffect.app)
    charges = client.hvals(f"{key}provider:charges")
    return [charge.decode() if isinstance(charge, bytes) else charge for charge in charges]


def refresh_crm_token(tooleffect: ToolHarness, customer_id: str) -> None:
    """sync_crm_contact's first call per customer meets an expired token (a dead
    letter of class ``auth``, crash or not): count that call as made."""
    client, key = world(tooleffect.app)
    client.set(f"{key}crm_calls:{customer_id}", 1)


def test_the_matrix_names_every_tool_at_every_boundary() -> None:
    for label, (tool, _args, _result) in CALLS.items():
        if label != "large refund":
            assert {boundary for call, boundary in EXPECTED if call == label} == set(
                BOUNDARIES), tool


@pytest.mark.parametrize(("call", "boundary"), list(EXPECTED))
def test_a_crash_at_each_boundary(tooleffect: ToolHarness, call: str, boundary: str) -> None:
    tool, args, returns = CALLS[call]
    settled, intents, outcomes, effects, step = EXPECTED[call, boundary]
    if tool == "agent.sync_crm_contact":
        refresh_crm_token(tooleffect, args[0])

    # At before_ack, run() returns once the redelivery left its mark in the
    # audit trail (a read: a second outcome; a write: duplicate_ignored).
    ending: Ending = tooleffect.run(tool, *args, crash_at=boundary, timeout=TIMEOUT)

    # A parked call reaches no boundary: nothing of it runs until a person decides.
    assert ending.crashed is (settled != "awaiting_approval"), ending.describe()
    assert ending.settled == settled, ending.describe()
    assert ending.intents == intents, ending.describe()
    assert ending.events.count(("outcome", "succeeded")) == outcomes, ending.describe()
    assert side_effects(tooleffect, tool) == effects, ending.describe()
    if step is not None:
        assert step in ending.events, ending.describe()
    if settled == "dead_letter":
        assert ending.dead_letter is not None
        assert ending.dead_letter.reason == "interrupted_write", ending.describe()
    elif settled == "succeeded":
        if returns == PROVIDER_CHARGE:
            assert provider_charges(tooleffect) == [ending.result], ending.describe()
        else:
            assert ending.result == returns, ending.describe()
