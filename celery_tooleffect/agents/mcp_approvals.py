"""The agent's user approves a call over MCP: elicitation before publishing.

A ``tools/call`` of a tool whose approver asks the user (``Approver.USER``,
or ``Approver.BOTH``: the user, then an operator) from a client that declared
elicitation (its ``elicitation`` capability, form mode) asks the client's
person before anything is published:

- on protocol 2026-07-28 the call is answered ``input_required``, with one
  form elicitation (:data:`APPROVAL_INPUT`) and a ``requestState`` that
  carries the call's identity (its call id, chosen now when the request named
  none, its run, its task id) and the digest of what the person is shown; the
  SDK's :class:`~mcp.server.request_state.RequestStateBoundary` seals it, bound
  to this tool, these arguments and this caller, so a client cannot alter it
  or reuse it for other arguments. The client retries ``tools/call`` with the
  person's answer;
- on the handshake versions (2025-11-25 and before) the server sends an
  ``elicitation/create`` request over the open call, and waits for the answer.

The answer is recorded as the user's decision
(:meth:`~.approvals.UserApprovals.decide`, ``via="mcp"``, by the caller's
identity): approved, the call is published and waited for as any call (for
``both``, it then waits for an operator); declined, dismissed or not approved,
the rejection is recorded, the call is published so that its status tells it,
and the answer is an ``isError`` result that says nothing ran. The worker
still enforces the decision: no decision for the digest shown, no run.

A client without elicitation gets the call published as any call: the worker
parks it, and its answer says that this client cannot ask its user, and what
an operator can do.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from ..errors import InvalidToolArguments
from ..states import ApprovalState, CallStatus
from .approvals import ApprovalAsk, UserApprovals
from .calls import CallReport, ToolCaller
from .oauth import Caller

__all__ = ["APPROVAL_INPUT", "APPROVAL_SCHEMA", "McpApprovals", "Proceed",
           "declares_elicitation"]

#: The key of the approval's elicitation in ``inputRequests``/``inputResponses``.
APPROVAL_INPUT = "tooleffect_approval"

#: What the person fills in: a form of one boolean and an optional reason.
APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "approve": {"type": "boolean", "title": "Approve",
                    "description": "Approve this call: it runs once, with exactly these "
                                   "arguments."},
        "reason": {"type": "string", "title": "Reason",
                   "description": "Why (optional; recorded with the decision)."},
    },
    "required": ["approve"],
}

#: The kind of the ``requestState`` this module mints (the SDK seals it).
STATE_KIND = "tooleffect.approval/1"

#: The longest reason recorded from a person's answer.
MAX_REASON = 500

_DISMISSED = {"decline": "declined", "cancel": "dismissed without a choice",
              "accept": "not approved"}


@dataclass(frozen=True)
class Proceed:
    """Publish the call with this identity (the call id chosen on the first
    round when the request named none)."""

    call_id: str | None
    run_id: str


def declares_elicitation(ctx: ServerRequestContext[Any]) -> bool:
    """Whether the request's client declared form elicitation: on 2026-07-28
    in the request's ``_meta`` capabilities, before in its handshake (an empty
    ``elicitation`` object is form mode, as 2025-06-18 defined it)."""
    capabilities = ctx.session.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    if elicitation is None:
        return False
    return elicitation.form is not None or elicitation.url is None


def approval_message(ask: ApprovalAsk) -> str:
    """What the person approving is shown: the package's question (for
    ``both``, it says that an operator approves it too), and what their
    answer does."""
    return (f"{ask.question()} Task id {ask.task_id}. Nothing of it has run; it runs only "
            "if you approve it, once, with exactly these arguments.")


class McpApprovals:
    """The user's approval of ``caller``'s tools, asked through the MCP client."""

    def __init__(self, caller: ToolCaller) -> None:
        self.caller = caller
        self.users = UserApprovals(caller)

    async def before_publish(self, ctx: ServerRequestContext[Any],
                             params: types.CallToolRequestParams, *, tool: str,
                             call_id: str | None, run_id: str, caller: Caller,
                             ) -> Proceed | types.CallToolResult | types.InputRequiredResult:
        """What comes before ``tool`` is published for this request: ask the
        person (``input_required``), or take their answer (the retry that
        carries it), or nothing (:class:`Proceed`: publish with this identity).
        A ``CallToolResult`` answers the call: nothing is to run."""
        arguments = params.arguments or {}
        if params.request_state is not None:
            state = _state_of(params.request_state, tool)
            response = (params.input_responses or {}).get(APPROVAL_INPUT)
            if isinstance(response, types.ElicitResult):
                return await self._decided(tool, arguments, state, response, caller)
            # No answer to the question: ask it again, for the same call.
            call_id, run_id = state["call_id"], state["run_id"]
            asked = await self._ask(ctx, tool, arguments, call_id, run_id, caller)
            return Proceed(call_id, run_id) if asked is None else asked
        if not declares_elicitation(ctx):
            return Proceed(call_id, run_id)
        # The call's identity is fixed now, for every round: the retry carries it.
        asked = await self._ask(ctx, tool, arguments, call_id or uuid.uuid4().hex, run_id,
                                caller)
        return Proceed(call_id, run_id) if asked is None else asked

    async def _ask(self, ctx: ServerRequestContext[Any], tool: str, arguments: dict[str, Any],
                   call_id: str, run_id: str, caller: Caller,
                   ) -> Proceed | types.CallToolResult | types.InputRequiredResult | None:
        """Ask the person, or None when nobody was asked (the call is
        published as any call: it needs no user's decision, has one, or the
        client could not be asked)."""
        try:
            ask = await anyio.to_thread.run_sync(
                partial(self.users.ask, tool, arguments, call_id=call_id, run_id=run_id))
        except InvalidToolArguments:
            return None  # the call answers REFUSED, as any call would
        if ask is None:  # no user's decision to ask (an operator's, or decided already)
            return None
        message = approval_message(ask)
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            request = types.ElicitRequest(params=types.ElicitRequestFormParams(
                message=message, requested_schema=APPROVAL_SCHEMA))
            state = {"kind": STATE_KIND, "tool": tool, "call_id": call_id, "run_id": run_id,
                     "task_id": ask.task_id, "digest": ask.digest}
            return types.InputRequiredResult(input_requests={APPROVAL_INPUT: request},
                                             request_state=json.dumps(state))
        # Handshake versions: elicitation/create over this request's channel.
        if not ctx.session.can_send_request:  # stateless HTTP: no way back to the client
            return None
        try:
            response = await ctx.session.elicit_form(message, APPROVAL_SCHEMA,
                                                     related_request_id=ctx.request_id)
        except MCPError:
            # The client did not answer the question: nobody decided, the
            # worker parks the call for its user or an operator.
            return None
        state = {"call_id": call_id, "run_id": run_id, "task_id": ask.task_id,
                 "digest": ask.digest}
        return await self._decided(tool, arguments, state, response, caller)

    async def _decided(self, tool: str, arguments: dict[str, Any], state: dict[str, Any],
                       response: types.ElicitResult, caller: Caller,
                       ) -> Proceed | types.CallToolResult:
        call_id, run_id = str(state["call_id"]), str(state["run_id"])
        content = response.content or {}
        approve = response.action == "accept" and content.get("approve") is True
        reason = content.get("reason")
        said = str(reason)[:MAX_REASON] if isinstance(reason, str) and reason.strip() else ""
        if not approve:
            said = said or _DISMISSED[response.action]
        by = caller.actor
        try:
            decided = await anyio.to_thread.run_sync(partial(
                self.users.decide, tool, arguments, call_id=call_id, run_id=run_id,
                approve=approve, seen=str(state["digest"]), by=by, reason=said, via="mcp"))
        except InvalidToolArguments as exc:
            return _refused(tool, call_id, run_id, "InvalidToolArguments", str(exc))
        if not decided and decided.state is ApprovalState.ABSENT:
            # Another digest than the one shown (or no user's approval to
            # give): nothing was recorded, nothing is published.
            return _refused(tool, call_id, run_id, "ApprovalRefused", decided.message)
        if decided.state is not ApprovalState.REJECTED:
            # Approved now, or decided already (a retry sent again): the
            # worker holds the call to the decision recorded.
            return Proceed(call_id, run_id)
        # Published all the same, so that its status tells it: the worker ends
        # it rejected, and its body never runs.
        submitted = await self.caller.submit(tool, arguments, call_id=call_id, run_id=run_id,
                                             caller=caller.header)
        task_id = submitted.task_id or str(state["task_id"])
        who = f"its user ({by})" if decided else "a person"
        rejected = CallReport(
            task_id, tool, CallStatus.REJECTED, run_id, call_id,
            error_type="ApprovalRejected", failure_class="client_error",
            error=f"rejected by {who} over MCP: {said}" if decided else decided.message,
            max_result_bytes=self.caller.max_result_bytes)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=rejected.message())],
            structured_content=rejected.to_dict(), is_error=True)


def _state_of(plaintext: str, tool: str) -> dict[str, Any]:
    """The ``requestState`` this module minted (the SDK unsealed it: only
    plaintext the server minted reaches here); ``-32602`` for any other."""
    try:
        state = json.loads(plaintext)
        valid = (isinstance(state, dict) and state.get("kind") == STATE_KIND
                 and state.get("tool") == tool
                 and all(isinstance(state.get(name), str) and state.get(name)
                         for name in ("call_id", "run_id", "task_id", "digest")))
    except ValueError:
        valid = False
    if not valid:
        raise MCPError(code=types.INVALID_PARAMS, message="Invalid or expired requestState")
    return dict(state)


def _refused(tool: str, call_id: str, run_id: str, error_type: str,
             error: str) -> types.CallToolResult:
    refused = CallReport("", tool, CallStatus.REFUSED, run_id, call_id, error_type=error_type,
                         failure_class="client_error",
                         error=f"{error}. Nothing was published, nothing of it runs.")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=refused.message())],
        structured_content=refused.to_dict(), is_error=True)
