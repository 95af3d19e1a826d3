"""The MCP server's streamable HTTP transport refuses a rebound name: every
address it listens on (each loopback spelling, and a wildcard with a token)
answers a request whose ``Host`` or ``Origin`` is ``evil.example`` with the
SDK's refusal, and nothing of it runs; this machine's own names pass."""

from __future__ import annotations

import json
import socket
from typing import Any

import anyio
import httpx2
import pytest

from tests.agents.conftest import Agents

EVIL = "evil.example"
ACCEPT = "application/json, text/event-stream"


def has_address(host: str) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as probe:
            probe.bind((host, 0))
    except OSError:
        return False
    return True


def post(url: str, message: dict[str, Any], headers: dict[str, str]) -> httpx2.Response:
    return httpx2.post(url, content=json.dumps(message), timeout=30, headers={
        "Accept": ACCEPT, "Content-Type": "application/json", **headers})


def invoice(key: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "shop.send_invoice", "arguments": {"key": key, "cents": 1}}}


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "rebinding-test", "version": "1"}}}


@pytest.mark.parametrize(("host", "token"), [
    ("127.0.0.1", None), ("127.0.0.2", None), ("localhost", None), ("::1", None),
    ("0:0:0:0:0:0:0:1", None), ("0.0.0.0", "s3cret"),
])
def test_a_rebound_host_or_origin_is_refused_on_every_address(
        agents: Agents, host: str, token: str | None) -> None:
    probe = "::1" if ":" in host else ("127.0.0.1" if host in ("localhost", "0.0.0.0")
                                        else host)
    if not has_address(probe):
        pytest.skip(f"this machine has no {probe} to listen on")
    agents.worker()
    url = agents.http_server(token=token, host=host)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    own = httpx2.URL(url).netloc.decode()
    key = f"rebind-{host}"

    # A session of this machine's own name: the refusals below are the checks'.
    opened = post(url, INITIALIZE, {**auth, "Host": own})
    assert opened.status_code == 200, opened.text
    session = {**auth, "mcp-session-id": opened.headers["mcp-session-id"],
               "mcp-protocol-version": "2025-11-25"}
    assert post(url, {"jsonrpc": "2.0", "method": "notifications/initialized"},
                {**session, "Host": own}).status_code == 202

    refusals = [
        (post(url, INITIALIZE, {**auth, "Host": EVIL}), 421, "Invalid Host header"),
        (post(url, INITIALIZE, {**auth, "Host": own, "Origin": f"http://{EVIL}"}), 403,
         "Invalid Origin header"),
        (post(url, invoice(key), {**session, "Host": f"{EVIL}:80"}), 421,
         "Invalid Host header"),
        (post(url, invoice(key), {**session, "Host": own, "Origin": f"https://{EVIL}"}), 403,
         "Invalid Origin header"),
        # The sessionless 2026-07-28 protocol goes through the same check.
        (post(url, invoice(key), {**auth, "Host": EVIL,
                                  "mcp-protocol-version": "2026-07-28"}), 421,
         "Invalid Host header"),
    ]
    for answer, status, said in refusals:
        assert (answer.status_code, answer.text) == (status, said)

    # The same call from this machine's own name and origin runs, once.
    scheme_host = f"http://{own}"
    ran = post(url, invoice(key), {**session, "Host": own, "Origin": scheme_host})
    assert ran.status_code == 200, ran.text
    assert f"INV-{key}-1" in ran.text
    assert agents.runs(key) == 1


def test_a_trusted_name_and_origin_are_accepted_beside_the_machines_own(
        agents: Agents) -> None:
    """``tooleffect_mcp_allowed_hosts`` / ``_origins``: a deployment's own names."""
    agents.env["TE_MCP_TRUST"] = "mcp.example.com|https://app.example.com"
    agents.worker()
    url = agents.http_server(token="s3cret", host="0.0.0.0")
    auth = {"Authorization": "Bearer s3cret"}
    trusted = post(url, INITIALIZE, {**auth, "Host": "mcp.example.com:8443",
                                     "Origin": "https://app.example.com"})
    assert trusted.status_code == 200, trusted.text
    assert post(url, INITIALIZE, {**auth, "Host": EVIL}).status_code == 421
    assert post(url, INITIALIZE, {**auth, "Host": "mcp.example.com",
                                  "Origin": "https://other.example.com"}).status_code == 403

    async def scenario() -> str:
        async with agents.http(url) as session:
            result = await session.call_tool("shop.quote", {"sku": "usb"})
            assert result.structured_content is not None
            return str(result.structured_content["status"])

    assert anyio.run(scenario) == "succeeded"
