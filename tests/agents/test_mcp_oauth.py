"""The MCP server as an OAuth 2.1 resource server (``tooleffect_mcp_oauth_*``),
against an issuer the test plays itself: an RSA key made here, its JWKS served
on a free port, access tokens signed here with PyJWT. The server runs as
``celery tooleffect mcp --transport streamable-http`` with real workers, and
the client is the ``mcp`` SDK's own, sending ``Authorization: Bearer``.
The same issuer answers RFC 7662 introspection for opaque tokens.

A token's scopes follow the effect: a read token calls a read tool (its
caller is in that call's audit events) and is neither shown nor let call a
write (nothing of it is published); an expired token, another issuer's, one
for another audience and one signed by a key the issuer never published are
answered 401; the static token still works beside them."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import anyio
import httpx2
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from celery_tooleffect.agents.oauth import (
    IDEMPOTENT_WRITE_SCOPE,
    READ_SCOPE,
    WRITE_SCOPE,
    Caller,
    IntrospectionVerifier,
    OAuthConfig,
    caller_of,
)
from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.store.runtime import runtime_for
from tests.agents.conftest import Agents, free_port
from tests.apps.agent_tools_app import build

AUDIENCE = "https://tools.example.com/mcp"
STATIC = "s3cret"
ACCEPT = "application/json, text/event-stream"
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "oauth-test", "version": "1"}}}


class Issuer:
    """An authorization server as far as a resource server sees one: its
    keys at ``/jwks.json`` (a tiny HTTP server on a free port), and the
    tokens it signs."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = uuid.uuid4().hex
        jwk = RSAAlgorithm.to_jwk(self.key.public_key(), as_dict=True)
        body = json.dumps({"keys": [{**jwk, "kid": self.kid, "alg": "RS256",
                                     "use": "sig"}]}).encode()
        #: What the introspection endpoint answers for each opaque token.
        self.introspected: dict[str, dict[str, Any]] = {}
        introspected = self.introspected

        class Keys(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                expected = "Basic " + base64.b64encode(b"mcp-server:pw").decode()
                if self.path != "/introspect" or self.headers["Authorization"] != expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                answer = introspected.get(form["token"][0], {"active": False})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(answer).encode())

            def do_GET(self) -> None:
                found = self.path == "/jwks.json"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body if found else b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", free_port()), Keys)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def token(self, scope: str, *, sub: str = "alice", client_id: str = "agent-7",
              iss: str | None = None, aud: str = AUDIENCE, expires_in: float = 600,
              key: rsa.RSAPrivateKey | None = None, kid: str | None = None) -> str:
        now = int(time.time())
        claims = {"iss": iss or self.url, "sub": sub, "aud": aud, "client_id": client_id,
                  "scope": scope, "iat": now, "exp": int(now + expires_in)}
        return jwt.encode(claims, key or self.key, algorithm="RS256",
                          headers={"kid": kid or self.kid})

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    server = Issuer()
    yield server
    server.close()


def oauth_server(agents: Agents, issuer: Issuer, **settings: Any) -> str:
    """A worker and an MCP server that accepts ``issuer``'s tokens and the static one."""
    port = free_port()
    agents.env["TE_MCP_OAUTH"] = json.dumps({
        "tooleffect_mcp_oauth_issuer": issuer.url,
        "tooleffect_mcp_oauth_audience": AUDIENCE,
        "tooleffect_mcp_oauth_jwks_url": f"{issuer.url}/jwks.json",
        "tooleffect_mcp_oauth_resource_url": f"http://127.0.0.1:{port}/mcp",
        **settings})
    agents.worker()
    return agents.http_server(token=STATIC, port=port)


def initialize(url: str, token: str) -> httpx2.Response:
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx2.post(url, content=json.dumps(INITIALIZE), timeout=30, headers={
        "Accept": ACCEPT, "Content-Type": "application/json", **auth})


def callers(agents: Agents, run_id: str) -> list[str]:
    """The ``caller`` of every audit event of ``run_id`` (one per event)."""
    events = runtime_for(build(agents.prefix)).audit.events(run_id)
    assert events, f"run {run_id} has no audit events"
    return [event.details.get("caller", "") for event in events]


def test_a_read_token_calls_reads_and_is_recorded_as_its_caller(
        agents: Agents, issuer: Issuer) -> None:
    url = oauth_server(agents, issuer)
    token = issuer.token(READ_SCOPE)

    async def scenario() -> tuple[list[str], Any]:
        async with agents.http(url, token=token) as session:
            names = [tool.name for tool in (await session.list_tools()).tools]
            quote = await session.call_tool("shop.quote", {"sku": "usb"},
                                            meta={"runId": "oauth-read"})
            return names, quote

    names, quote = anyio.run(scenario)
    # Only what the token may call is shown: the reads and the status tool.
    assert "shop.quote" in names and "tooleffect_call_status" in names
    assert "shop.send_invoice" not in names and "shop.refund" not in names
    assert not quote.is_error, quote
    assert quote.structured_content["result"] == {"sku": "usb", "cents": 1999}
    recorded = callers(agents, "oauth-read")
    assert {json.loads(caller)["auth"] for caller in recorded} == {"oauth"}
    assert json.loads(recorded[0]) == {"auth": "oauth", "iss": issuer.url, "sub": "alice",
                                       "client_id": "agent-7"}


def test_a_read_token_cannot_call_a_write_and_nothing_is_published(
        agents: Agents, issuer: Issuer) -> None:
    url = oauth_server(agents, issuer)
    key = f"refused-{uuid.uuid4().hex[:8]}"

    async def refused() -> Any:
        async with agents.http(url, token=issuer.token(READ_SCOPE)) as session:
            return await session.call_tool(
                "shop.send_invoice", {"key": key, "cents": 1},
                meta={"runId": "oauth-refused", "idempotencyKey": "inv-1"})

    answer = anyio.run(refused)
    assert answer.is_error
    assert answer.structured_content is not None
    assert answer.structured_content["status"] == "refused"
    assert answer.structured_content["error_type"] == "InsufficientScope"
    assert WRITE_SCOPE in answer.structured_content["error"]
    assert "Nothing was published" in answer.structured_content["error"]

    # Nothing of it exists anywhere: no event, no journal entry, no claim, no
    # message (any key of the run), and the body never ran.
    runtime = runtime_for(build(agents.prefix))
    assert runtime.audit.events("oauth-refused") == []
    assert list(agents.redis.scan_iter(match="*oauth-refused*", count=1000)) == []
    assert not any(event.tool == "shop.send_invoice" for event in runtime.audit.tail(1000))

    # The same call with a write token runs: once, as its first run, and the
    # audit events name the write token's subject.
    async def allowed() -> Any:
        async with agents.http(url, token=issuer.token(
                f"{WRITE_SCOPE} {READ_SCOPE}", sub="bob")) as session:
            return await session.call_tool(
                "shop.send_invoice", {"key": key, "cents": 1},
                meta={"runId": "oauth-refused", "idempotencyKey": "inv-1"})

    ran = anyio.run(allowed)
    assert not ran.is_error, ran
    assert ran.structured_content["result"] == f"INV-{key}-1"
    assert agents.runs(key) == 1
    assert {json.loads(caller)["sub"] for caller in callers(agents, "oauth-refused")} == {"bob"}
    # A published call leaves keys of its run: the scan above would have seen them.
    assert list(agents.redis.scan_iter(match="*oauth-refused*", count=1000))


def test_tokens_this_server_must_not_accept_are_answered_401(
        agents: Agents, issuer: Issuer) -> None:
    url = oauth_server(agents, issuer)
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    refused = {
        "expired": issuer.token(READ_SCOPE, expires_in=-300),
        "another issuer": issuer.token(READ_SCOPE, iss="https://elsewhere.example"),
        "another audience": issuer.token(READ_SCOPE, aud="https://other.example/mcp"),
        "a key the issuer never published": issuer.token(READ_SCOPE, key=stranger),
        "an unknown key id": issuer.token(READ_SCOPE, key=stranger, kid="nobody"),
        "no token at all": "",
    }
    for why, token in refused.items():
        answer = initialize(url, token)
        assert answer.status_code == 401, (why, answer.status_code, answer.text)
        # The client is told where to learn how to get a token (RFC 9728).
        assert "resource_metadata=" in answer.headers["www-authenticate"], why
    assert initialize(url, issuer.token(READ_SCOPE)).status_code == 200

    port = httpx2.URL(url).port
    metadata = httpx2.get(f"http://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp",
                          timeout=30).json()
    assert metadata["resource"] == f"http://127.0.0.1:{port}/mcp"
    assert metadata["authorization_servers"] == [issuer.url]
    assert metadata["scopes_supported"] == [READ_SCOPE, IDEMPOTENT_WRITE_SCOPE, WRITE_SCOPE]


def test_the_static_token_still_calls_every_tool_beside_oauth(
        agents: Agents, issuer: Issuer) -> None:
    url = oauth_server(agents, issuer)
    key = f"static-{uuid.uuid4().hex[:8]}"

    async def scenario() -> tuple[list[str], Any]:
        async with agents.http(url, token=STATIC) as session:
            names = [tool.name for tool in (await session.list_tools()).tools]
            return names, await session.call_tool(
                "shop.send_invoice", {"key": key, "cents": 1}, meta={"runId": "oauth-static"})

    names, ran = anyio.run(scenario)
    assert "shop.send_invoice" in names
    assert not ran.is_error, ran
    assert agents.runs(key) == 1
    assert set(callers(agents, "oauth-static")) == {'{"auth":"static-token"}'}


def test_scopes_follow_the_effect() -> None:
    """What each scope lets a token call (and ``tool:<name>`` when asked for)."""
    read, idem, write = (ToolEffect.READ_ONLY, ToolEffect.IDEMPOTENT_WRITE,
                         ToolEffect.NON_IDEMPOTENT_WRITE)

    def missing(scopes: str, effect: ToolEffect, tool_scopes: bool = False) -> str:
        caller = Caller("oauth", scopes=frozenset(scopes.split()))
        return caller.missing_scope("shop.x", effect, tool_scopes=tool_scopes)

    assert [missing(READ_SCOPE, e) for e in (read, idem, write)] == [
        "", IDEMPOTENT_WRITE_SCOPE, WRITE_SCOPE]
    assert [missing(IDEMPOTENT_WRITE_SCOPE, e) for e in (read, idem, write)] == [
        "", "", WRITE_SCOPE]
    assert [missing(WRITE_SCOPE, e) for e in (read, idem, write)] == ["", "", ""]
    assert missing("", read) == READ_SCOPE
    assert missing(WRITE_SCOPE, read, tool_scopes=True) == "tool:shop.x"
    assert missing(f"{READ_SCOPE} tool:shop.x", read, tool_scopes=True) == ""
    assert missing("tool:shop.x", read, tool_scopes=True) == READ_SCOPE
    # The static token, stdio and a loopback server without a token: every tool.
    assert Caller("static-token").missing_scope("shop.x", write, tool_scopes=True) == ""


def test_an_opaque_token_is_checked_by_the_issuers_introspection(issuer: Issuer) -> None:
    """RFC 7662: active, of the issuer (when named), for the audience, unexpired;
    the server authenticates to the endpoint with its client credentials."""
    now = time.time()
    good = {"active": True, "iss": issuer.url, "aud": [AUDIENCE, "other"], "sub": "carol",
            "client_id": "agent-9", "scope": f"{READ_SCOPE} tool:shop.quote",
            "exp": int(now + 600)}
    issuer.introspected.update({
        "good": good,
        "inactive": {**good, "active": False},
        "foreign": {**good, "iss": "https://elsewhere.example"},
        "other-audience": {**good, "aud": "https://other.example/mcp"},
        "no-audience": {key: value for key, value in good.items() if key != "aud"},
        "expired": {**good, "exp": int(now - 600)},
    })
    config = OAuthConfig(issuer=issuer.url, audience=AUDIENCE,
                         introspection_url=f"{issuer.url}/introspect",
                         client_id="mcp-server", client_secret="pw")
    verifier = IntrospectionVerifier(config)

    async def verify(token: str) -> Any:
        return await verifier.verify_token(token)

    access = anyio.run(verify, "good")
    assert access is not None
    assert caller_of(access) == Caller("oauth", issuer=issuer.url, subject="carol",
                                       client_id="agent-9",
                                       scopes=frozenset({READ_SCOPE, "tool:shop.quote"}))
    for token in ("inactive", "foreign", "other-audience", "no-audience", "expired", "unknown"):
        assert anyio.run(verify, token) is None, token
    wrong_secret = IntrospectionVerifier(OAuthConfig(
        issuer=issuer.url, audience=AUDIENCE, introspection_url=f"{issuer.url}/introspect",
        client_id="mcp-server", client_secret="guess"))
    assert anyio.run(wrong_secret.verify_token, "good") is None
