"""What agents are told, decided without services: the Host and Origin
values the MCP transport accepts, results cut to the model's share, and the
notice of a cancelled call."""

from __future__ import annotations

import pytest

from celery_tooleffect.agents.calls import CallReport
from celery_tooleffect.agents.mcp_server import cancel_notice, transport_security
from celery_tooleffect.states import CallStatus

LOOPBACK = ["127.0.0.1", "127.0.0.1:*", "localhost", "localhost:*", "[::1]", "[::1]:*"]


@pytest.mark.parametrize(("host", "own"), [
    ("127.0.0.1", []), ("localhost", []), ("::1", []), ("0.0.0.0", []), ("::", []),
    ("127.0.0.2", ["127.0.0.2", "127.0.0.2:*"]),
    ("0:0:0:0:0:0:0:1", ["[0:0:0:0:0:0:0:1]", "[0:0:0:0:0:0:0:1]:*"]),
    ("10.0.0.5", ["10.0.0.5", "10.0.0.5:*"]),
    ("mcp.internal", ["mcp.internal", "mcp.internal:*"]),
])
def test_the_checks_are_on_for_every_address(host: str, own: list[str]) -> None:
    security = transport_security(host, ["mcp.example.com:443"], ["https://app.example.com"])
    assert security.enable_dns_rebinding_protection
    assert security.allowed_hosts == [*LOOPBACK, *own, "mcp.example.com:443"]
    assert security.allowed_origins == [
        *(f"http://{name}" for name in [*LOOPBACK, *own]),
        "https://app.example.com", "https://app.example.com:*"]
    assert not any("evil" in name for name in security.allowed_hosts)


def test_a_result_longer_than_the_share_is_cut_whole_characters_with_a_note() -> None:
    report = CallReport("t-1", "shop.export", CallStatus.SUCCEEDED, result="\u00e9" * 10,
                        max_result_bytes=7)
    assert report.result_cut
    shown, note = report.message().split("\n[cut: ")
    assert shown == "\u00e9" * 3  # 6 bytes: the seventh would split a character
    assert note.startswith("the result is 20 bytes of text; the first 6 are shown and 14 cut")
    assert "task_id t-1" in note and "calling shop.export again shows no more" in note
    data = report.to_dict()
    assert "result" not in data
    assert (data["result_truncated"], data["result_bytes"]) == (True, 20)
    small = CallReport("t-2", "shop.export", CallStatus.SUCCEEDED, result={"a": 1})
    assert not small.result_cut and small.message() == '{"a": 1}'
    assert small.to_dict()["result"] == {"a": 1}


def test_the_status_tool_answer_for_an_unknown_id_names_nothing() -> None:
    report = CallReport("t-9", "", CallStatus.UNKNOWN)
    assert not report.is_error and not report.status.ended
    assert report.to_dict() == {"status": "unknown", "tool": "", "task_id": "t-9",
                                "message": report.message()}
    assert report.message().startswith("No call of the tools served here has task_id t-9")


@pytest.mark.parametrize(("status", "started", "said"), [
    (CallStatus.QUEUED, False, "its body had not started"),
    (CallStatus.AWAITING_APPROVAL, False, "nothing of it had run"),
    (CallStatus.RUNNING, True, "its body had started"),
    (CallStatus.SUCCEEDED, None, "it had already ended (succeeded)"),
])
def test_a_cancelled_calls_notice_says_whether_its_body_started(
        status: CallStatus, started: bool | None, said: str) -> None:
    notice = cancel_notice(CallReport("t-3", "shop.send_invoice", status))
    assert (notice["task_id"], notice["status"], notice["body_started"]) == (
        "t-3", status.value, started)
    assert said in notice["message"]
    assert "Ask tooleffect_call_status with task_id t-3 how it ended" in notice["message"]
