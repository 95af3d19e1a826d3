"""Who calls the MCP server over streamable HTTP, and which tools they may call.

The server is an OAuth 2.1 resource server as the MCP specification's
authorization section describes, through the ``mcp`` SDK's own machinery
(its ``TokenVerifier`` protocol, bearer middleware and RFC 9728 protected
resource metadata): it issues no token and runs no authorization server. A
bearer token is accepted when it is

- the static token (``tooleffect_mcp_token``), compared in constant time: the
  operator's shared secret, which may call every tool; or
- an access token of the configured issuer (``tooleffect_mcp_oauth_issuer``):
  a JWT whose signature verifies with the issuer's keys
  (``tooleffect_mcp_oauth_jwks_url``) and whose ``iss``, ``aud``
  (``tooleffect_mcp_oauth_audience``) and ``exp`` are right, or a token the
  issuer's RFC 7662 introspection endpoint
  (``tooleffect_mcp_oauth_introspection_url``) answers active for that
  issuer and audience.

Scopes follow the effect (:data:`EFFECT_SCOPES`): ``tools:read`` calls the
read-only tools, ``tools:write:idempotent`` idempotent writes too,
``tools:write`` every tool. A deployment may also ask for ``tool:<name>``
per tool (``tooleffect_mcp_oauth_tool_scopes``). A token is shown only the
tools it may call, and a call of any other is refused before anything is
published.

Who called (:class:`Caller`) travels with the call in the
``tooleffect_caller`` message header and is recorded in every audit event of
the call (``details.caller``).
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from mcp.server.auth.provider import AccessToken, TokenVerifier

from ..effect import ToolEffect
from ..errors import ConfigurationError
from ..identity import MAX_CALLER_LENGTH

if TYPE_CHECKING:
    from ..settings import Settings

#: The scope of each effect. A scope also grants every less strict effect:
#: ``tools:write`` calls every tool, ``tools:write:idempotent`` idempotent
#: writes and reads, ``tools:read`` reads only.
READ_SCOPE = "tools:read"
IDEMPOTENT_WRITE_SCOPE = "tools:write:idempotent"
WRITE_SCOPE = "tools:write"
EFFECT_SCOPES: Mapping[ToolEffect, str] = {
    ToolEffect.READ_ONLY: READ_SCOPE,
    ToolEffect.IDEMPOTENT_WRITE: IDEMPOTENT_WRITE_SCOPE,
    ToolEffect.NON_IDEMPOTENT_WRITE: WRITE_SCOPE,
}
#: With ``tooleffect_mcp_oauth_tool_scopes``, a call of tool ``name`` also
#: needs the scope ``tool:<name>``.
TOOL_SCOPE_PREFIX = "tool:"

#: The signature algorithms a JWT may use: asymmetric only, so that a key
#: the issuer publishes can never serve as an HMAC secret.
JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                  "ES256", "ES384", "ES512", "EdDSA")
#: Seconds ``nbf`` and ``iat`` may be ahead of this server's clock. ``exp``
#: gets none in effect: the SDK's bearer middleware refuses a token whose
#: ``expires_at`` has passed.
LEEWAY = 30.0
#: Seconds an answer of the issuer's keys or introspection endpoint is waited for.
ISSUER_TIMEOUT = 10.0

#: The client id the static token is recorded as.
STATIC_TOKEN = "static-token"


@dataclass(frozen=True)
class Caller:
    """Who made a call, as the server authenticated them.

    ``auth`` is how: ``oauth`` (an access token of ``issuer`` for
    ``subject``, obtained by ``client_id``), ``static-token``, ``none`` (HTTP
    on a loopback address without a token) or ``stdio`` (whoever started the
    server process). ``scopes`` is None when the caller may call every tool.
    """

    auth: str
    issuer: str = ""
    subject: str = ""
    client_id: str = ""
    scopes: frozenset[str] | None = None

    def missing_scope(self, tool: str, effect: ToolEffect, *, tool_scopes: bool) -> str:
        """The scope this caller lacks to call ``tool`` ('' when it lacks none)."""
        if self.scopes is None:
            return ""
        granted = max((effect_.strictness for effect_, scope in EFFECT_SCOPES.items()
                       if scope in self.scopes), default=-1)
        if granted < effect.strictness:
            return EFFECT_SCOPES[effect]
        if tool_scopes and f"{TOOL_SCOPE_PREFIX}{tool}" not in self.scopes:
            return f"{TOOL_SCOPE_PREFIX}{tool}"
        return ""

    @property
    def actor(self) -> str:
        """Who decides, as an approval's audit event names them: the token's
        subject, else its client id, else ``mcp:<auth>`` (``mcp:stdio``,
        ``mcp:static-token``, ``mcp:none``)."""
        return self.subject or self.client_id or f"mcp:{self.auth}"

    @property
    def header(self) -> str:
        """The caller as the ``tooleffect_caller`` header and the audit events'
        ``caller`` detail: compact JSON of its set fields, scopes aside (at
        most :data:`~celery_tooleffect.identity.MAX_CALLER_LENGTH` characters;
        a longer subject or client id is cut)."""
        fields = {"auth": self.auth, "iss": self.issuer, "sub": self.subject,
                  "client_id": self.client_id}
        text = json.dumps({name: value for name, value in fields.items() if value},
                          separators=(",", ":"), ensure_ascii=False)
        while len(text) > MAX_CALLER_LENGTH:
            longest = max(("sub", "client_id", "iss"), key=lambda name: len(fields[name]))
            fields[longest] = fields[longest][: len(fields[longest]) // 2] + "..."
            text = json.dumps({name: value for name, value in fields.items() if value},
                              separators=(",", ":"), ensure_ascii=False)
        return text


#: Whoever started a stdio server, and an HTTP client of a loopback server without a token.
STDIO_CALLER = Caller("stdio")
ANONYMOUS_CALLER = Caller("none")


class StaticAccessToken(AccessToken):
    """The static token, as the SDK's bearer middleware holds it."""


def caller_of(token: AccessToken | None) -> Caller:
    """The caller a verified token names (``ANONYMOUS_CALLER`` for None)."""
    if token is None:
        return ANONYMOUS_CALLER
    if isinstance(token, StaticAccessToken):
        return Caller("static-token")
    claims = token.claims or {}
    return Caller("oauth", issuer=str(claims.get("iss") or ""), subject=token.subject or "",
                  client_id=token.client_id, scopes=frozenset(token.scopes))


def static_access_token(token: str) -> StaticAccessToken:
    """The static token's access: every scope, no expiry."""
    return StaticAccessToken(token=token, client_id=STATIC_TOKEN,
                             scopes=list(EFFECT_SCOPES.values()))


@dataclass(frozen=True)
class OAuthConfig:
    """What the server checks a token against (``tooleffect_mcp_oauth_*``)."""

    issuer: str
    audience: str
    jwks_url: str = ""
    introspection_url: str = ""
    client_id: str = ""
    client_secret: str = ""
    #: This server's URL as its clients reach it (RFC 9728's ``resource``).
    resource_url: str = ""
    tool_scopes: bool = False

    @classmethod
    def of(cls, settings: Settings) -> OAuthConfig | None:
        """The app's configuration, or None when no issuer is configured."""
        if not settings.mcp_oauth_issuer:
            return None
        if not settings.mcp_oauth_audience:
            raise ConfigurationError(
                "tooleffect_mcp_oauth_issuer needs tooleffect_mcp_oauth_audience: the "
                "audience (aud) of the tokens issued for this server, usually its URL")
        if bool(settings.mcp_oauth_jwks_url) == bool(settings.mcp_oauth_introspection_url):
            raise ConfigurationError(
                "tooleffect_mcp_oauth_issuer needs one of tooleffect_mcp_oauth_jwks_url (the "
                "issuer's keys, for JWT access tokens) or tooleffect_mcp_oauth_introspection_url"
                " (RFC 7662), not both")
        config = cls(issuer=settings.mcp_oauth_issuer,
                   audience=settings.mcp_oauth_audience or "",
                   jwks_url=settings.mcp_oauth_jwks_url or "",
                   introspection_url=settings.mcp_oauth_introspection_url or "",
                   client_id=settings.mcp_oauth_client_id or "",
                   client_secret=settings.mcp_oauth_client_secret or "",
                   resource_url=settings.mcp_oauth_resource_url or "",
                   tool_scopes=settings.mcp_oauth_tool_scopes)
        if not config.resource:
            raise ConfigurationError(
                "set tooleffect_mcp_oauth_resource_url, this server's URL as its clients reach "
                "it (https://mcp.example.com/mcp): the audience is no URL, and the server "
                "publishes its protected-resource metadata (RFC 9728) under it")
        return config

    @property
    def resource(self) -> str:
        """The protected resource's URL: ``resource_url``, else the audience
        when it is an ``http(s)`` URL (MCP clients ask for tokens with the
        server's URL as RFC 8707 resource, which becomes their audience)."""
        if self.resource_url:
            return self.resource_url
        return self.audience if self.audience.startswith(("https://", "http://")) else ""


class JwtVerifier:
    """A JWT access token of ``config.issuer``, verified against the issuer's
    published keys (JWKS, fetched and cached by PyJWT's ``PyJWKClient``):
    its signature (asymmetric algorithms only), ``iss``, ``aud`` and ``exp``
    (all required; :data:`LEEWAY` for ``nbf`` and ``iat``)."""

    def __init__(self, config: OAuthConfig) -> None:
        import jwt

        self.config = config
        self.keys = jwt.PyJWKClient(config.jwks_url, cache_keys=True, lifespan=300,
                                    timeout=ISSUER_TIMEOUT)

    async def verify_token(self, token: str) -> AccessToken | None:
        return await anyio.to_thread.run_sync(self.verify, token)

    def verify(self, token: str) -> AccessToken | None:
        """The token's access, or None when it is not one this server accepts (blocking)."""
        import jwt

        try:
            key = self.keys.get_signing_key_from_jwt(token)
            claims = jwt.decode(
                token, key.key, algorithms=list(JWT_ALGORITHMS), audience=self.config.audience,
                issuer=self.config.issuer, leeway=LEEWAY,
                options={"require": ["exp", "iss", "aud"]})
        except jwt.PyJWTError:
            return None
        return _access(token, claims, self.config.audience)


class IntrospectionVerifier:
    """An opaque (or any) token the issuer's RFC 7662 introspection endpoint
    answers ``active`` for, issued by ``config.issuer`` (when the answer
    names an issuer) for ``config.audience`` (the answer must name it), not
    expired. The server authenticates to the endpoint with
    ``tooleffect_mcp_oauth_client_id`` / ``_client_secret`` (HTTP Basic)."""

    def __init__(self, config: OAuthConfig) -> None:
        self.config = config

    async def verify_token(self, token: str) -> AccessToken | None:
        import httpx2

        auth = ((self.config.client_id, self.config.client_secret)
                if self.config.client_id else None)
        try:
            async with httpx2.AsyncClient(timeout=ISSUER_TIMEOUT) as client:
                answer = await client.post(
                    self.config.introspection_url, auth=auth,
                    data={"token": token, "token_type_hint": "access_token"},
                    headers={"Accept": "application/json"})
            claims = answer.json() if answer.status_code == 200 else None
        except (httpx2.HTTPError, ValueError):
            return None
        if not isinstance(claims, dict) or claims.get("active") is not True:
            return None
        if claims.get("iss") not in (None, self.config.issuer):
            return None
        if self.config.audience not in _audiences(claims.get("aud")):
            return None
        expires = claims.get("exp")
        if isinstance(expires, (int, float)) and expires < time.time():
            return None
        return _access(token, {"iss": self.config.issuer, **claims}, self.config.audience)


class ServerVerifier:
    """The SDK's ``TokenVerifier`` of the server: the static token, if one is
    set, else the issuer's verification, if configured."""

    def __init__(self, static_token: str | None, issuer: TokenVerifier | None) -> None:
        self.expected = static_token.encode() if static_token else None
        self.issuer = issuer

    async def verify_token(self, token: str) -> AccessToken | None:
        if self.expected is not None and hmac.compare_digest(token.encode(), self.expected):
            return static_access_token(token)
        if self.issuer is None:
            return None
        return await self.issuer.verify_token(token)


def issuer_verifier(config: OAuthConfig) -> TokenVerifier:
    """The verifier of ``config``: JWKS when a keys URL is set, else introspection."""
    if config.jwks_url:
        return JwtVerifier(config)
    return IntrospectionVerifier(config)


def _access(token: str, claims: Mapping[str, Any], audience: str) -> AccessToken:
    expires = claims.get("exp")
    return AccessToken(
        token=token,
        client_id=str(claims.get("client_id") or claims.get("azp") or claims.get("cid") or ""),
        scopes=sorted(_scopes(claims)),
        expires_at=int(expires) if isinstance(expires, (int, float)) else None,
        resource=audience,
        subject=str(claims["sub"]) if claims.get("sub") is not None else None,
        claims={"iss": str(claims.get("iss") or "")},
    )


def _scopes(claims: Mapping[str, Any]) -> set[str]:
    """``scope`` (RFC 9068: space-separated) or ``scp`` (a list or text)."""
    found: set[str] = set()
    for name in ("scope", "scp"):
        value = claims.get(name)
        if isinstance(value, str):
            found.update(value.split())
        elif isinstance(value, list):
            found.update(str(item) for item in value)
    return found


def _audiences(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [str(item) for item in value]
    return []


__all__ = ["ANONYMOUS_CALLER", "EFFECT_SCOPES", "IDEMPOTENT_WRITE_SCOPE", "READ_SCOPE",
           "STDIO_CALLER", "TOOL_SCOPE_PREFIX", "WRITE_SCOPE", "Caller", "IntrospectionVerifier",
           "JwtVerifier", "OAuthConfig", "ServerVerifier", "caller_of", "issuer_verifier"]
