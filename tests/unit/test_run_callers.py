"""Who made each call of a run, as the run page and the approval page show
it: the caller its audit events record (the ``tooleffect_caller`` header the
MCP server sets), folded into the call's summary and labelled for a person."""

from __future__ import annotations

import json

from celery_tooleffect.admin.runs import caller_label, caller_of_events
from celery_tooleffect.store.runs import CallSummary

OAUTH = json.dumps({"auth": "oauth", "iss": "https://issuer.example", "sub": "ana",
                    "client_id": "desk"}, separators=(",", ":"))


def test_a_calls_summary_keeps_the_caller_its_events_record() -> None:
    call = CallSummary("t1")
    call.add({"ts": "1.0", "phase": "intent", "status": "started", "tool": "shop.wire",
              "caller": OAUTH})
    call.add({"ts": "2.0", "phase": "outcome", "status": "succeeded", "caller": OAUTH})
    assert call.caller == OAUTH and call.to_dict()["caller"] == OAUTH
    nobody = CallSummary("t2")
    nobody.add({"ts": "1.0", "phase": "outcome", "status": "succeeded"})
    assert nobody.caller == "" and nobody.to_dict()["caller"] is None


def test_the_caller_is_labelled_for_a_person() -> None:
    assert caller_label(OAUTH) == "ana (https://issuer.example)"
    assert caller_label(json.dumps({"auth": "oauth", "client_id": "desk"})) == "desk"
    assert caller_label('{"auth":"static-token"}') == "static token"
    assert caller_label('{"auth":"stdio"}') == "stdio"
    assert caller_label('{"auth":"none"}') == "no token"
    assert caller_label("") == "—"
    # A producer's own text is shown as it is, never dropped.
    assert caller_label("billing-service") == "billing-service"
    assert caller_label('["not", "an object"]') == '["not", "an object"]'


def test_the_approval_page_names_the_first_caller_its_events_record() -> None:
    events = [{"phase": "approval", "status": "requested"},
              {"phase": "approval", "status": "approved", "caller": OAUTH}]
    assert caller_of_events(events) == OAUTH
    assert caller_of_events([{"phase": "approval", "status": "requested"}]) == ""
