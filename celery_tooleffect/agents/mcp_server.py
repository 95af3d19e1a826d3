"""The app's tools as an MCP server (``celery -A app tooleffect mcp``), on the
official ``mcp`` SDK's low-level ``Server`` (extra ``mcp``).

Each tool is listed with the schema, title, description and annotations of its
:class:`~celery_tooleffect.agents.schema.ToolSpec`; ``tools/call`` publishes
the task through :class:`~celery_tooleffect.agents.calls.ToolCaller` and
answers with a :class:`~celery_tooleffect.agents.calls.CallReport`: its
message as text, the report as ``structuredContent``, ``isError`` for every
failed ending (a failure, a dead letter, a rejection, arguments that do not
fit). Progress notifications follow the call while it is queued, running or
parked; a call that has not ended within ``tooleffect_mcp_result_wait`` (50 s,
below the TypeScript SDK client's 60 s default request timeout) is answered
with how it stands. A client that declares MCP's Tasks extension gets a task
at once instead (:mod:`celery_tooleffect.agents.mcp_tasks`). One more tool,
``tooleffect_call_status``, answers how an earlier call of a tool served here
stands ("unknown" for any other task id). Operator
actions (replay, purge, approve) are never tools.

A call's identity (``docs/identity.md``) comes from the request's ``_meta``:

- ``idempotencyKey``: the call id; a call resent with the same key (and run)
  is the same call, answered with its first outcome, never run twice. Without
  one, every request is a new call.
- ``runId``: the run; else the MCP session (``Mcp-Session-Id`` over stateful
  HTTP), else the server process's own id (stdio: one client, one session
  per process). An HTTP request without a session names no run: with an
  ``idempotencyKey`` it is refused unless it sends ``runId``.

Over streamable HTTP the server asks every request for ``Authorization:
Bearer``: the static ``tooleffect_mcp_token``, or an access token of the
configured OAuth issuer (``tooleffect_mcp_oauth_*``: an OAuth 2.1 resource
server through the SDK's own token verification, with RFC 9728 metadata;
:mod:`.oauth`). Only on a loopback address may it run without either.
Whatever the address, and with a token too, the SDK's Host and Origin checks
are on (:func:`transport_security`).

Scopes follow the effect (:data:`~.oauth.EFFECT_SCOPES`): ``tools/list``
shows a token only the tools it may call, and a call of another is answered
``isError`` (REFUSED, ``InsufficientScope``) before anything is published.
Who called (:class:`~.oauth.Caller`) is published with the call and recorded
in each of its audit events (``details.caller``).

A tool whose approver asks the agent's user is asked of a client that
declared elicitation before anything is published (``input_required`` on
2026-07-28, ``elicitation/create`` on the handshake versions); its answer is
the user's decision (:mod:`.mcp_approvals`). A client without elicitation
gets the call parked, and an answer that names the operator's path.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import ipaddress
import logging
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.extension import compose_tool_call_handler
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

from ..errors import ConfigurationError
from ..settings import settings_for
from ..states import CallStatus
from .calls import STATUS_TOOL, CallReport, ToolCaller
from .mcp_approvals import McpApprovals, Proceed
from .mcp_tasks import ToolTasks
from .oauth import (
    ANONYMOUS_CALLER,
    EFFECT_SCOPES,
    STDIO_CALLER,
    Caller,
    OAuthConfig,
    ServerVerifier,
    caller_of,
    issuer_verifier,
    static_access_token,
)
from .schema import ToolSpec

if TYPE_CHECKING:
    from celery import Celery
    from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

#: ``_meta`` keys of a ``tools/call`` request that name the call and its run.
IDEMPOTENCY_KEY = "idempotencyKey"
RUN_ID_KEY = "runId"

#: The logger name of the notification that tells a cancelled call's client
#: what became of the call, and how long telling it may take.
CANCEL_LOGGER = "celery_tooleffect.cancelled"
CANCEL_NOTICE_WAIT = 10.0

_STATUS_INPUT = {
    "type": "object",
    "properties": {
        "task_id": {"type": "string", "description": "The task id a call answered with."},
        "run_id": {"type": "string",
                   "description": "The call's run id, if it was given one (_meta runId)."},
    },
    "required": ["task_id"],
    "additionalProperties": False,
}


class ToolServer:
    """An MCP server of ``app``'s tools (those matching ``patterns``, else all).

    Building it describes every tool: a tool whose signature cannot be
    described raises :class:`~celery_tooleffect.errors.ToolSchemaError` here,
    before the server serves anything.
    """

    def __init__(self, app: Celery, *, patterns: Iterable[str] = (),
                 caller: ToolCaller | None = None, name: str = "celery-tooleffect",
                 result_wait: float | None = None) -> None:
        self.app = app
        self.caller = caller or ToolCaller.for_app(app)
        #: How long a ``tools/call`` is waited for before it is answered with
        #: how the call stands (``tooleffect_mcp_result_wait``, never longer
        #: than the caller's own wait): below the 60 s default request timeout
        #: of the TypeScript SDK's client, which would give up on it otherwise.
        self.result_wait = min(
            settings_for(app).mcp_result_wait if result_wait is None else result_wait,
            self.caller.result_wait)
        self.specs: dict[str, ToolSpec] = {
            spec.name: spec for spec in map(self.caller.spec, self.caller.tools(patterns))}
        if STATUS_TOOL in self.specs:
            raise ConfigurationError(f"a tool may not be named {STATUS_TOOL}: the server's own")
        #: A call also needs the scope ``tool:<name>`` (``tooleffect_mcp_oauth_tool_scopes``).
        self.tool_scopes = settings_for(app).mcp_oauth_tool_scopes
        #: The run of a request that names none and has no session (stdio).
        self.process_run_id = uuid.uuid4().hex
        self.server: Server[Any] = Server(
            name, version=importlib.metadata.version("celery-tooleffect"),
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            instructions=("Tools run as Celery tasks. A write is never run twice: when a "
                          f"call answers that it is waiting or still running, ask {STATUS_TOOL}"
                          " with its task_id instead of calling the tool again."),
        )
        # The user's approval over MCP (elicitation): the retry of an
        # ``input_required`` answer carries the call's identity in its
        # requestState, sealed by the SDK (the lowlevel Server installs no
        # boundary by itself), bound to the tool, its arguments and the caller.
        # The key is this process's: a retry must reach the same server process.
        self.approvals = McpApprovals(self.caller)
        self.server.middleware.append(
            RequestStateBoundary(RequestStateSecurity.ephemeral(), default_audience=name))
        # MCP's Tasks extension, through the SDK's extension interface as
        # MCPServer(extensions=...) applies one: its methods, its capability,
        # and its interceptor around tools/call.
        self.tasks = ToolTasks(app, self.caller, self.specs, start=self._start_task,
                               answer=lambda report: _result(report, is_error=report.is_error))
        for method in self.tasks.methods():
            self.server.add_request_handler(method.method, method.params_type, method.handler)
        self.server.extensions[self.tasks.identifier] = self.tasks.settings()
        self.server.add_request_handler(
            "tools/call", types.CallToolRequestParams,
            compose_tool_call_handler([self.tasks], self._call_tool))

    # -- the tools --------------------------------------------------------------

    def tools(self, caller: Caller = STDIO_CALLER) -> list[types.Tool]:
        """What ``tools/list`` answers ``caller``: every tool it may call, then
        the status tool."""
        listed = [
            types.Tool(
                name=spec.name, title=spec.title, description=spec.description,
                input_schema=spec.input_schema, output_schema=spec.output_schema,
                annotations=types.ToolAnnotations(
                    title=spec.title,
                    read_only_hint=spec.annotations["readOnlyHint"],
                    destructive_hint=spec.annotations["destructiveHint"],
                    idempotent_hint=spec.annotations["idempotentHint"],
                    open_world_hint=spec.annotations["openWorldHint"],
                ),
            )
            for spec in self.callable_by(caller).values()
        ]
        listed.append(types.Tool(
            name=STATUS_TOOL, title="How an earlier tool call stands",
            description=("How a call that answered 'awaiting_approval', 'queued' or 'running' "
                         "stands now: its result once it succeeded, or why it failed."),
            input_schema=_STATUS_INPUT,
            annotations=types.ToolAnnotations(
                title="How an earlier tool call stands", read_only_hint=True,
                destructive_hint=False, idempotent_hint=True, open_world_hint=False),
        ))
        return listed

    def callable_by(self, caller: Caller) -> dict[str, ToolSpec]:
        """The served tools ``caller``'s scopes let it call."""
        return {name: spec for name, spec in self.specs.items()
                if not caller.missing_scope(name, spec.effect, tool_scopes=self.tool_scopes)}

    def who_calls(self, ctx: ServerRequestContext[Any]) -> Caller:
        """Who sent the request: the token the SDK's bearer middleware (or
        :class:`BearerToken`) verified; ``stdio`` over stdio, ``none`` over
        HTTP without a token (a loopback server without one)."""
        request = ctx.request
        if request is None:
            return STDIO_CALLER
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser

        user = request.scope.get("user")
        if isinstance(user, AuthenticatedUser):
            return caller_of(user.access_token)
        return ANONYMOUS_CALLER

    async def _list_tools(self, ctx: ServerRequestContext[Any],
                          params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools(self.who_calls(ctx)))

    async def _call_tool(self, ctx: ServerRequestContext[Any],
                         params: types.CallToolRequestParams,
                         ) -> types.CallToolResult | types.InputRequiredResult:
        meta: dict[str, Any] = dict(ctx.meta or {})
        given_run = meta.get(RUN_ID_KEY) or self.session_run_id(ctx)
        arguments = params.arguments or {}
        caller = self.who_calls(ctx)
        if params.name == STATUS_TOOL:
            task_id = arguments.get("task_id")
            if not isinstance(task_id, str) or not task_id:
                return _error_text(f"{STATUS_TOOL}: give the task_id a call answered with")
            report = await self.caller.status(
                task_id, run_id=str(arguments.get("run_id") or given_run or ""),
                tools=self.callable_by(caller))
            return _result(report, is_error=False)
        ready = await self._ready(ctx, params, caller)
        if not isinstance(ready, tuple):  # refused, or the person is asked or said no
            return ready
        spec, call_id, run_id = ready
        steps = 0

        async def progress(report: CallReport) -> None:
            nonlocal steps
            steps += 1
            await ctx.session.report_progress(steps, None, f"{spec.name}: {report.status.value}"
                                              f" (task_id {report.task_id})")

        published: list[str] = []
        try:
            report = await self.caller.call(
                spec.name, arguments, call_id=call_id, run_id=run_id, progress=progress,
                published=published.append, caller=caller.header,
                result_wait=self.result_wait)
        except anyio.get_cancelled_exc_class():
            # notifications/cancelled: the protocol lets the server answer the
            # request with nothing, so the client is told before it ends.
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_NOTICE_WAIT):
                await self._tell_cancelled(ctx, spec.name, published, run_id, steps + 1)
            raise
        return _result(report, is_error=report.is_error)

    async def _ready(self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams,
                     caller: Caller,
                     ) -> types.CallToolResult | types.InputRequiredResult | tuple[
                         ToolSpec, str | None, str]:
        """A ``tools/call`` ready to publish: its tool, call id and run, once
        its identity holds and its user approved it where the user is asked
        (:meth:`_identity`, then ``before_publish``); else the answer to give."""
        identity = self._identity(ctx, params, caller)
        if isinstance(identity, types.CallToolResult):
            return identity
        spec, call_id, run_id = identity
        before = await self.approvals.before_publish(ctx, params, tool=spec.name,
                                                     call_id=call_id, run_id=run_id,
                                                     caller=caller)
        if not isinstance(before, Proceed):
            return before
        return spec, before.call_id, before.run_id

    def _identity(self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams,
                  caller: Caller) -> types.CallToolResult | tuple[ToolSpec, str | None, str]:
        """The tool, call id and run of a ``tools/call`` (of a served tool, not
        the status tool) by ``caller``, or the refusal to answer when they
        make no call (a tool its scopes do not let it call)."""
        meta: dict[str, Any] = dict(ctx.meta or {})
        given_run = meta.get(RUN_ID_KEY) or self.session_run_id(ctx)
        spec = self.specs.get(params.name)
        if spec is None:
            # A JSON-RPC error, as the SDK answers a method it does not know.
            raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown tool: {params.name}")
        call_id = meta.get(IDEMPOTENCY_KEY)
        missing = caller.missing_scope(spec.name, spec.effect, tool_scopes=self.tool_scopes)
        if missing:
            refused = CallReport(
                "", spec.name, CallStatus.REFUSED, call_id=str(call_id or ""),
                error_type="InsufficientScope", failure_class="client_error",
                error=f"this token lacks the scope {missing} that a call of {spec.name} "
                      f"({spec.effect.value}) needs. Nothing was published: ask for a token "
                      "with that scope.")
            return _result(refused, is_error=True)
        if not given_run and call_id is not None:
            refused = CallReport(
                "", spec.name, CallStatus.REFUSED, call_id=str(call_id),
                error_type="InvalidCallId", failure_class="client_error",
                error=f"an {IDEMPOTENCY_KEY} needs a run, and this request has no session and "
                      f"no _meta {RUN_ID_KEY}: send _meta {RUN_ID_KEY} (the conversation's id) "
                      "with it. Nothing was published.")
            return _result(refused, is_error=True)
        # A request without a key is a call of its own: its run is its own too.
        return spec, None if call_id is None else str(call_id), str(given_run or uuid.uuid4().hex)

    async def _start_task(self, ctx: ServerRequestContext[Any],
                          params: types.CallToolRequestParams,
                          ) -> types.CallToolResult | types.InputRequiredResult | tuple[str, str]:
        """Publish a ``tools/call`` without waiting for it (a client of the
        Tasks extension): its task id and run, or the answer when nothing was
        published (the person is asked first, or said no)."""
        caller = self.who_calls(ctx)
        ready = await self._ready(ctx, params, caller)
        if not isinstance(ready, tuple):  # refused, or the person is asked or said no
            return ready
        spec, call_id, run_id = ready
        report = await self.caller.submit(spec.name, params.arguments or {}, call_id=call_id,
                                          run_id=run_id, caller=caller.header)
        if report.status is CallStatus.REFUSED:
            return _result(report, is_error=True)
        return report.task_id, run_id

    async def _tell_cancelled(self, ctx: ServerRequestContext[Any], tool: str,
                              published: list[str], run_id: str, step: int) -> None:
        """Tell the client of a cancelled ``tools/call`` what became of the
        call: a log notification (``notifications/message``, level
        ``warning``, logger :data:`CANCEL_LOGGER`) whose data names the task
        id, how the call stood and that the status tool tells how it ends,
        and the same text as a progress notification when the client asked
        for progress."""
        try:
            if not published:
                notice: dict[str, Any] = {
                    "event": "cancelled", "tool": tool, "task_id": None, "status": None,
                    "body_started": False,
                    "message": f"{tool}: cancelled before it was published; nothing of it "
                               "was sent, and nothing of it runs."}
            else:
                report = await anyio.to_thread.run_sync(
                    self.caller.observe, published[0], tool, run_id, "", 0.0)
                notice = cancel_notice(report)
            await ctx.session.send_log_message(
                "warning", notice, logger=CANCEL_LOGGER, related_request_id=ctx.request_id)
            await ctx.session.report_progress(step, None, str(notice["message"]))
        except Exception:  # the client may be gone too: the call is in Celery's hands
            logger.debug("could not tell a cancelled call's client", exc_info=True)

    def session_run_id(self, ctx: ServerRequestContext[Any]) -> str | None:
        """The run of a request without ``_meta.runId``: its MCP session over
        stateful HTTP; over stdio this server process's (it serves one client,
        one session); None for an HTTP request without a session (stateless,
        or the 2026-07-28 protocol), which names no run."""
        request = ctx.request
        if request is None:
            return self.process_run_id
        session = request.headers.get("mcp-session-id")
        return str(session) if session else None

    # -- serving ----------------------------------------------------------------

    async def serve_stdio(self) -> None:
        """Serve one client over standard input and output until it closes them."""
        from mcp.server.stdio import stdio_server

        async with stdio_server() as (read_stream, write_stream):
            await self.server.run(read_stream, write_stream,
                                  self.server.create_initialization_options())

    def http_app(self, *, host: str, token: str | None, path: str = "/mcp",
                 allowed_hosts: Iterable[str] | None = None,
                 allowed_origins: Iterable[str] | None = None) -> ASGIApp:
        """The streamable HTTP app: the SDK's, with its Host and Origin checks
        on whatever ``host`` is (:func:`transport_security`), asking every
        request for a bearer token: ``token`` (the static one), or, when an
        OAuth issuer is configured (``tooleffect_mcp_oauth_*``), an access
        token of that issuer, verified by the SDK's bearer middleware through
        :class:`~.oauth.ServerVerifier`, with the SDK's RFC 9728 metadata at
        ``/.well-known/oauth-protected-resource<path>`` naming the issuer and
        the scopes. ``allowed_hosts`` and ``allowed_origins`` are what a
        deployment trusts besides this machine's names (default: the
        ``tooleffect_mcp_allowed_*`` settings). Without a token or an issuer
        only a loopback ``host`` is served (``ConfigurationError`` otherwise)."""
        settings = settings_for(self.app)
        oauth = OAuthConfig.of(settings)
        if not token and oauth is None and not is_loopback(host):
            raise ConfigurationError(
                f"the MCP server listens on {host}, beyond this machine: set "
                "tooleffect_mcp_token (or --token-env) so that clients must present it, or "
                "tooleffect_mcp_oauth_issuer")
        security = transport_security(
            host, settings.mcp_allowed_hosts if allowed_hosts is None else allowed_hosts,
            settings.mcp_allowed_origins if allowed_origins is None else allowed_origins)
        if oauth is None:
            app = self.server.streamable_http_app(streamable_http_path=path, host=host,
                                                  transport_security=security)
            return BearerToken(app, token) if token else app
        from mcp.server.auth.routes import create_protected_resource_routes
        from mcp.server.auth.settings import AuthSettings

        # The verifier checks the audience itself (PyJWT, or the introspection
        # answer): the SDK's own resource check compares another field.
        auth = AuthSettings(issuer_url=oauth.issuer,  # type: ignore[arg-type]
                            resource_server_url=oauth.resource,  # type: ignore[arg-type]
                            validate_token_resource=False)
        starlette = self.server.streamable_http_app(
            streamable_http_path=path, host=host, transport_security=security, auth=auth,
            token_verifier=ServerVerifier(token, issuer_verifier(oauth)))
        # The SDK's metadata names no scopes (its AuthSettings' required
        # scopes would be asked of every request): the same document, with them.
        metadata = create_protected_resource_routes(
            auth.resource_server_url,  # type: ignore[arg-type]
            [auth.issuer_url], scopes_supported=list(EFFECT_SCOPES.values()))
        paths = {route.path for route in metadata}
        starlette.router.routes[:] = [
            *(route for route in starlette.router.routes
              if getattr(route, "path", None) not in paths), *metadata]
        return starlette

    async def serve_http(self, *, host: str, port: int, token: str | None,
                         path: str = "/mcp") -> None:
        """Serve streamable HTTP on ``host:port`` until cancelled."""
        import uvicorn

        config = uvicorn.Config(self.http_app(host=host, token=token, path=path), host=host,
                                port=port, log_level="warning", lifespan="on")
        await uvicorn.Server(config).serve()

    def run(self, transport: str = "stdio", *, host: str = "127.0.0.1", port: int = 8000,
            token: str | None = None) -> None:
        """Serve until stopped: ``stdio`` or ``streamable-http``."""
        if transport == "stdio":
            anyio.run(self.serve_stdio)
        elif transport == "streamable-http":
            anyio.run(lambda: self.serve_http(host=host, port=port, token=token))
        else:
            raise ConfigurationError(f"unknown MCP transport {transport!r}: "
                                     "stdio or streamable-http")


class BearerToken:
    """An ASGI wrapper that answers 401 to a request without ``Authorization:
    Bearer <token>`` (compared in constant time), and marks a request with it
    as the static token's (the ``user`` of its scope, as the SDK's bearer
    middleware marks a verified token's). Pure ASGI, so that the SDK's event
    streams pass through untouched."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                from starlette.responses import JSONResponse

                answer = JSONResponse({"error": "invalid_token",
                                       "error_description": "a bearer token is required"},
                                      status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await answer(scope, receive, send)
                return
            from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
            from starlette.authentication import AuthCredentials

            access = static_access_token(self.token)
            scope = {**scope, "user": AuthenticatedUser(access),
                     "auth": AuthCredentials(access.scopes)}
        await self.app(scope, receive, send)


#: The names by which a client on this machine reaches a server on it.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def transport_security(host: str, hosts: Iterable[str] = (),
                       origins: Iterable[str] = ()) -> TransportSecuritySettings:
    """The SDK's DNS-rebinding protection for a server listening on ``host``,
    always on: it accepts a ``Host`` of :data:`LOOPBACK_NAMES`, of ``host`` as
    spelt and in its canonical form (not a wildcard such as ``0.0.0.0``), and
    of ``hosts``, each with any port; an ``Origin`` of ``http://`` those
    names, and ``origins``. Anything else is answered 421 (Host) or 403
    (Origin) before the request reaches the server. The SDK turns its check
    on by itself only for ``127.0.0.1``, ``localhost`` and ``::1``: a browser
    page of a rebound name must not reach ``127.0.0.2`` or a server that
    trusts a token alone either."""
    names = list(LOOPBACK_NAMES)
    bare = host.strip("[]")
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        names.append(host)
    else:
        if not address.is_unspecified:
            if address.version == 6:
                names += [f"[{bare}]", f"[{address.compressed}]"]
            else:
                names.append(address.compressed)
    trusted = [*names, *hosts]
    allowed_origins = [f"http://{name}" for name in names]
    allowed_origins += [*origins]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=_any_port(trusted), allowed_origins=_any_port(allowed_origins))


def _any_port(names: Iterable[str]) -> list[str]:
    """Each name as given and, unless it names one already, with any port."""
    allowed: list[str] = []
    for name in dict.fromkeys(names):
        allowed.append(name)
        if not name.endswith(":*") and not _has_port(name):
            allowed.append(f"{name}:*")
    return allowed


def _has_port(name: str) -> bool:
    tail = name.rsplit("]", 1)[-1].split("//", 1)[-1]
    return ":" in tail and tail.rsplit(":", 1)[1].isdigit()


def cancel_notice(report: CallReport) -> dict[str, Any]:
    """What the client of a cancelled call is told, from how it stands: a
    cancelled request stops the waiting, never the call."""
    tool, task, status = report.tool, report.task_id, report.status
    started: bool | None
    if status is CallStatus.QUEUED:
        stood, started = ("it was queued: no worker had reported it started, so its "
                          "body had not started as far as the package knows; it runs when a "
                          "worker takes it"), False
    elif status is CallStatus.AWAITING_APPROVAL:
        stood, started = ("it was waiting for a person's approval: nothing of it had run; "
                          "it runs if approved"), False
    elif status is CallStatus.RUNNING:
        stood, started = "it was running: its body had started and goes on", True
    else:
        stood, started = f"it had already ended ({status.value})", None
    return {"event": "cancelled", "tool": tool, "task_id": task, "status": status.value,
            "body_started": started,
            "message": (f"{tool} (task_id {task}): the client cancelled its wait, not the "
                        f"call; {stood}. Ask {STATUS_TOOL} with task_id {task} how it ended; "
                        "do not call it again.")}


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _result(report: CallReport, *, is_error: bool) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=report.message())],
        structured_content=report.to_dict(), is_error=is_error)


def _error_text(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                is_error=True)


__all__ = ["CANCEL_LOGGER", "IDEMPOTENCY_KEY", "RUN_ID_KEY", "BearerToken", "ToolServer",
           "cancel_notice", "transport_security"]
