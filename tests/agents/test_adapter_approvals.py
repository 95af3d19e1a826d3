"""The agent's user approves a call through each SDK's own pause and resume
(issue 42, item 2): the OpenAI Agents SDK's interruptions and ``RunState``,
pydantic-ai's deferred tools; each run by its SDK's own test model against a
real ``celery worker`` of ``tests.apps.agent_tools_app`` (``shop.wire``: its
user approves, shown the account masked; ``shop.payout``: its user then an
operator; ``shop.refund``: an operator alone). The worker's side of it is in
``test_user_approvals.py``."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import pytest

from celery_tooleffect import ApprovalState, AuditLog, call_task_id
from tests.agents.conftest import Agents
from tests.apps.agent_tools_app import build
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(180)

ACCOUNT = "DE89370400440532013000"
MASKED = {"view": {"account": "****3000", "amount": "5.00"}}


def wire(key: str, cents: int = 500) -> dict[str, Any]:
    return {"key": key, "account": ACCOUNT, "cents": cents}


def approval_events(app: Any, run: str, task_id: str) -> list[dict[str, Any]]:
    return [event for event in AuditLog(app).events(run)
            if event["task_id"] == task_id and event["phase"] == "approval"]


# -- OpenAI Agents SDK ----------------------------------------------------------------

Call = tuple[str, dict[str, Any], str]


def oa_agent(app: Any, turns: list[list[Call]]) -> tuple[Any, Any]:
    """A new agent with new tools of ``app`` and a scripted model: the
    model's tool calls by turn, then "done"."""
    from agents import Agent
    from agents.testing import ScriptedModel, assistant_message, function_call

    from celery_tooleffect.agents.openai_agents import openai_agents_tools

    model = ScriptedModel([*([function_call(name, arguments, call_id=call_id)
                              for name, arguments, call_id in turn] for turn in turns),
                           [assistant_message("done")]])
    return Agent(name="shop", model=model, tools=openai_agents_tools(app)), model


def oa_outputs(model: Any) -> dict[str, str]:
    """What the model was told of each call id, in its last request."""
    return {item["call_id"]: str(item["output"]) for item in model.calls[-1].input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


def oa_config(run: str | None) -> Any:
    from agents import RunConfig

    return RunConfig(trace_id=run, tracing_disabled=True)


def test_openai_agents_pause_approve_resume_in_another_process_runs_once(
        agents: Agents) -> None:
    """Paused in one process, its state saved as JSON; the worker restarted;
    a new app, new tools and a new agent read the state, the person approves
    what they were shown, the run resumes: the wire ran once, the audit has
    the user's approval; resumed again from the saved state, it gets the
    same result, not a second run."""
    from agents import Runner, RunState

    from celery_tooleffect.agents import openai_agents as oa

    first = agents.worker()
    app = build(agents.prefix)
    key, run = uuid.uuid4().hex[:8], f"trace_{uuid.uuid4().hex}"
    agent, _ = oa_agent(app, [[("shop_wire", wire(key), "call_w")]])
    paused = anyio.run(lambda: Runner.run(agent, "go", run_config=oa_config(run)))
    assert len(paused.interruptions) == 1
    saved = json.dumps(paused.to_state().to_json())
    assert agents.runs(key) == 0

    first.kill()
    agents.worker()
    app2 = build(agents.prefix)  # another process's objects
    agent2, model2 = oa_agent(app2, [])

    digests: list[str] = []

    async def resume(saved: str, person: str | None) -> Any:
        state = await RunState.from_json(agent2, json.loads(saved))
        [item] = state.get_interruptions()
        ask = oa.approval_request(state, item, app2, run_config=oa_config(run))
        digests.append(ask.digest)
        if person is not None:
            assert ask.shown == MASKED and ask.approver == "user"
            assert ask.task_id == call_task_id("call_w", run)
            decided = oa.approve(state, item, by=person, seen=ask.digest, run_config=oa_config(run))
            assert decided, decided.message
        else:  # decided before: the helper follows the record
            assert not oa.approve(state, item, by="ana", seen=ask.digest, run_config=oa_config(run))
        return await Runner.run(agent2, state, run_config=oa_config(run))

    done = anyio.run(resume, saved, "ana@example.com")
    assert done.final_output == "done" and not done.interruptions
    task_id = call_task_id("call_w", run)
    said = oa_outputs(model2)["call_w"]
    assert said.strip('"') == "wired 500 to ****3000 (1)", said
    assert agents.runs(key) == 1
    [approved] = approval_events(app2, run, task_id)
    assert (approved["status"], approved["actor"], approved["via"], approved["shown_digest"]) \
        == ("approved", "ana@example.com", "openai-agents", digests[0])

    # The same saved state resumed again: the call ran; its result, once.
    agent2, model2 = oa_agent(app2, [])
    again = anyio.run(resume, saved, None)
    assert again.final_output == "done"
    assert oa_outputs(model2)["call_w"].strip('"') == "wired 500 to ****3000 (1)"
    assert agents.runs(key) == 1


def test_openai_agents_without_a_run_id_approve_one_reject_another(agents: Agents) -> None:
    """A run without trace id or group id, decided and resumed in its
    process: the approved wire runs once, the rejected one never, and the
    model is told who rejected it and why."""
    from agents import Runner

    from celery_tooleffect.agents import openai_agents as oa

    agents.worker()
    app = build(agents.prefix)
    key, other = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    agent, model = oa_agent(app, [[("shop_wire", wire(key), "call_a"),
                                   ("shop_wire", wire(other, 900), "call_b")]])

    async def go() -> str:
        paused = await Runner.run(agent, "go", run_config=oa_config(None))
        yes, no = paused.interruptions
        state = paused.to_state()
        ask = oa.approval_request(state, yes)
        assert oa.approve(state, yes, by="ana", seen=ask.digest).state \
            is ApprovalState.APPROVED
        rejected = oa.reject(state, no, by="ana", reason="wrong account")
        assert rejected.state is ApprovalState.REJECTED, rejected.message
        done = await Runner.run(agent, state, run_config=oa_config(None))
        assert done.final_output == "done"
        return oa.approval_request(state, no).task_id

    rejected_task = anyio.run(go)
    told = oa_outputs(model)
    assert told["call_a"].strip('"') == "wired 500 to ****3000 (1)", told
    assert "shop.wire was rejected by ana: wrong account; it did not run" in told["call_b"]
    assert rejected_task in told["call_b"]
    assert agents.runs(key) == 1 and agents.runs(other) == 0


def test_openai_agents_approving_other_arguments_than_shown_is_refused(
        agents: Agents) -> None:
    from agents import Runner

    from celery_tooleffect.agents import openai_agents as oa

    agents.worker()
    app = build(agents.prefix)
    key, run = uuid.uuid4().hex[:8], f"trace_{uuid.uuid4().hex}"
    agent, _ = oa_agent(app, [[("shop_wire", wire(key), "call_small"),
                               ("shop_wire", wire(key, 5_000_000), "call_big")]])

    async def go() -> None:
        paused = await Runner.run(agent, "go", run_config=oa_config(run))
        small, big = paused.interruptions
        state = paused.to_state()
        shown = oa.approval_request(state, small, run_config=oa_config(run))
        # The person saw 5.00; the app approves the 50,000.00 call with it.
        refused = oa.approve(state, big, by="ana", seen=shown.digest, run_config=oa_config(run))
        assert not refused and "not those shown" in refused.message
        ask = oa.approval_request(state, big, run_config=oa_config(run))
        assert recorded_state(app, ask.task_id, run) is ApprovalState.ABSENT
        assert state._context is not None
        assert state._context.is_tool_approved("shop_wire", "call_big") is None

    anyio.run(go)
    assert agents.runs(key) == 0


def test_openai_agents_a_call_approved_by_both_waits_for_an_operator_after_its_user(
        agents: Agents) -> None:
    """``shop.payout``: its user approves through the SDK's pause; the
    resumed call is published and waits for an operator, who approves it."""
    from agents import Runner

    from celery_tooleffect import Approvals
    from celery_tooleffect.agents import openai_agents as oa

    agents.worker()
    app = build(agents.prefix)
    key, run = uuid.uuid4().hex[:8], f"trace_{uuid.uuid4().hex}"
    agent, model = oa_agent(app, [[("shop_payout", {"key": key, "cents": 9_000}, "call_p")]])

    async def go() -> str:
        paused = await Runner.run(agent, "go", run_config=oa_config(run))
        [item] = paused.interruptions
        state = paused.to_state()
        ask = oa.approval_request(state, item, run_config=oa_config(run))
        assert ask.approver == "both" and "then an operator" in ask.question()
        decided = oa.approve(state, item, by="ana", seen=ask.digest, run_config=oa_config(run))
        assert decided.state is ApprovalState.USER_APPROVED, decided.message
        done = await Runner.run(agent, state, run_config=oa_config(run))
        assert done.final_output == "done"
        return ask.task_id

    task_id = anyio.run(go)
    assert ("approved by its user and is waiting for an operator"
            in oa_outputs(model)["call_p"])
    assert agents.runs(key) == 0
    wait_for(lambda: (lambda a: a is not None and a.message is not None)(
        Approvals(app).get(task_id)), timeout=30, what="the call to be parked")
    assert Approvals(app).approve(task_id, by="olga").ok
    assert app.AsyncResult(task_id).get(timeout=60) == "paid out 9000 (1)"
    assert agents.runs(key) == 1
    assert [(e["status"], e.get("actor", "")) for e in approval_events(app, run, task_id)] == [
        ("user_approved", "ana"), ("requested", ""), ("approved", "olga")]


def recorded_state(app: Any, task_id: str, run: str) -> ApprovalState:
    from celery_tooleffect.agents import ToolCaller
    from celery_tooleffect.agents.approvals import UserApprovals

    return UserApprovals(ToolCaller.for_app(app)).state(task_id, run)


def test_openai_agents_an_operators_approval_is_no_pause(agents: Agents) -> None:
    """``shop.refund`` (an operator approves it) does not interrupt the run:
    its call is parked in the worker and answers that it waits."""
    from agents import Runner

    agents.worker()
    app = build(agents.prefix)
    key, run = uuid.uuid4().hex[:8], f"trace_{uuid.uuid4().hex}"
    agent, model = oa_agent(app, [[("shop_refund", {"key": key, "cents": 700}, "call_r")]])
    done = anyio.run(lambda: Runner.run(agent, "go", run_config=oa_config(run)))
    assert done.final_output == "done" and not done.interruptions
    assert "waiting for a person's approval" in oa_outputs(model)["call_r"]
    assert agents.runs(key) == 0


# -- pydantic-ai ----------------------------------------------------------------------


def pa_agent(app: Any, calls: list[Call]) -> Any:
    """A new agent with new tools of ``app`` whose ``FunctionModel`` makes
    ``calls`` first, then says "done" once it was told of their outcomes."""
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from celery_tooleffect.agents.pydantic_ai import pydantic_ai_tools

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        told = isinstance(last, ModelRequest) and any(
            part.part_kind in ("tool-return", "retry-prompt") for part in last.parts)
        if told:
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart(name, arguments, tool_call_id=call_id)
                                    for name, arguments, call_id in calls])

    return Agent(FunctionModel(script), tools=pydantic_ai_tools(app),
                 output_type=[str, DeferredToolRequests])


def pa_told(messages: list[Any]) -> dict[str, tuple[str, str]]:
    """What the model was told of each call id: (text, outcome)."""
    from pydantic_ai.messages import ModelRequest, RetryPromptPart, ToolReturnPart

    told: dict[str, tuple[str, str]] = {}
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, ToolReturnPart):
                    told[part.tool_call_id] = (part.model_response_str(), part.outcome)
                elif isinstance(part, RetryPromptPart) and part.tool_call_id:
                    told[part.tool_call_id] = (part.model_response(), "retry")
    return told


def test_pydantic_ai_pause_approve_resume_in_another_process_runs_once(
        agents: Agents) -> None:
    """Deferred in one process, its messages and requests saved as JSON; the
    worker restarted; a new app, new tools and a new agent resume with the
    person's approval: the wire ran once, the audit has the user's approval;
    resumed again from the saved messages, it gets the same result."""
    from pydantic import TypeAdapter
    from pydantic_ai import DeferredToolRequests, DeferredToolResults
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    from celery_tooleffect.agents import pydantic_ai as pa

    first = agents.worker()
    app = build(agents.prefix)
    key = uuid.uuid4().hex[:8]
    paused = anyio.run(lambda: pa_agent(app, [("shop_wire", wire(key), "call_w")]).run("go"))
    assert isinstance(paused.output, DeferredToolRequests)
    [part] = paused.output.approvals
    assert paused.output.metadata["call_w"]["shown"] == MASKED
    saved_messages = ModelMessagesTypeAdapter.dump_json(paused.all_messages())
    saved_requests = TypeAdapter(DeferredToolRequests).dump_json(paused.output)
    run = paused.conversation_id
    assert agents.runs(key) == 0

    first.kill()
    agents.worker()
    app2 = build(agents.prefix)  # another process's objects
    digests: list[str] = []

    async def resume(person: str | None) -> Any:
        messages = ModelMessagesTypeAdapter.validate_json(saved_messages)
        requests = TypeAdapter(DeferredToolRequests).validate_json(saved_requests)
        conversation = pa.conversation_of(messages)
        assert conversation == run
        results = DeferredToolResults()
        for part in requests.approvals:
            ask = pa.approval_request(part, app2, conversation_id=conversation)
            digests.append(ask.digest)
            assert ask.shown == MASKED and ask.task_id == call_task_id("call_w", run)
            decided = pa.approve(results, part, app2, conversation_id=conversation,
                                 by=person or "ana", seen=ask.digest)
            assert bool(decided) is (person is not None), decided.message
        agent = pa_agent(app2, [("shop_wire", wire(key), "call_w")])
        return await agent.run(message_history=messages, deferred_tool_results=results)

    done = anyio.run(resume, "ana@example.com")
    assert done.output == "done"
    assert pa_told(done.all_messages())["call_w"] == ("wired 500 to ****3000 (1)", "success")
    assert agents.runs(key) == 1
    [approved] = approval_events(app2, run, call_task_id("call_w", run))
    assert (approved["status"], approved["actor"], approved["via"], approved["shown_digest"]) \
        == ("approved", "ana@example.com", "pydantic-ai", digests[0])

    # Resumed again from the saved messages: the call ran; its result, once.
    again = anyio.run(resume, None)
    assert pa_told(again.all_messages())["call_w"] == ("wired 500 to ****3000 (1)", "success")
    assert agents.runs(key) == 1
    assert part.tool_call_id == "call_w"


def test_pydantic_ai_reject_tells_the_model_and_nothing_runs(agents: Agents) -> None:
    from pydantic_ai import DeferredToolResults

    from celery_tooleffect.agents import pydantic_ai as pa

    agents.worker()
    app = build(agents.prefix)
    key = uuid.uuid4().hex[:8]
    agent = pa_agent(app, [("shop_wire", wire(key), "call_w")])

    async def go() -> Any:
        paused = await agent.run("go")
        [part] = paused.output.approvals
        results = DeferredToolResults()
        rejected = pa.reject(results, part, app, conversation_id=paused.conversation_id,
                             by="ana", reason="wrong account")
        assert rejected.state is ApprovalState.REJECTED, rejected.message
        return await agent.run(message_history=paused.all_messages(),
                               deferred_tool_results=results)

    done = anyio.run(go)
    assert done.output == "done"
    said, outcome = pa_told(done.all_messages())["call_w"]
    assert "shop.wire was rejected by ana: wrong account; it did not run" in said, said
    assert outcome == "denied"
    assert agents.runs(key) == 0


def test_pydantic_ai_approving_other_arguments_than_shown_is_refused(
        agents: Agents) -> None:
    from pydantic_ai import DeferredToolResults

    from celery_tooleffect.agents import pydantic_ai as pa

    agents.worker()
    app = build(agents.prefix)
    key = uuid.uuid4().hex[:8]
    agent = pa_agent(app, [("shop_wire", wire(key), "call_small"),
                           ("shop_wire", wire(key, 5_000_000), "call_big")])

    async def go() -> None:
        paused = await agent.run("go")
        small, big = paused.output.approvals
        run = paused.conversation_id
        shown = pa.approval_request(small, app, conversation_id=run)
        results = DeferredToolResults()
        # The person saw 5.00; the app approves the 50,000.00 call with it.
        refused = pa.approve(results, big, app, conversation_id=run, by="ana",
                             seen=shown.digest)
        assert not refused and "not those shown" in refused.message
        assert results.approvals == {}
        ask = pa.approval_request(big, app, conversation_id=run)
        assert recorded_state(app, ask.task_id, run) is ApprovalState.ABSENT

    anyio.run(go)
    assert agents.runs(key) == 0


def test_pydantic_ai_approved_without_the_helper_does_not_run(agents: Agents) -> None:
    """The app approves in pydantic-ai alone (``DeferredToolResults`` it
    built itself): no decision of its user is on record, so the call is not
    published and the model is told why."""
    from pydantic_ai import DeferredToolResults

    agents.worker()
    app = build(agents.prefix)
    key = uuid.uuid4().hex[:8]
    agent = pa_agent(app, [("shop_wire", wire(key), "call_w")])

    async def go() -> Any:
        paused = await agent.run("go")
        return await agent.run(message_history=paused.all_messages(),
                               deferred_tool_results=DeferredToolResults(
                                   approvals={"call_w": True}))

    done = anyio.run(go)
    said, _ = pa_told(done.all_messages())["call_w"]
    assert "its user's decision was not recorded" in said, said
    assert "pydantic_ai.approve()" in said
    assert agents.runs(key) == 0
    assert not list(AuditLog(app).events(done.conversation_id))  # nothing was published


def test_pydantic_ai_an_operators_approval_is_no_pause(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    key = uuid.uuid4().hex[:8]
    agent = pa_agent(app, [("shop_refund", {"key": key, "cents": 700}, "call_r")])
    done = anyio.run(lambda: agent.run("go"))
    assert done.output == "done"
    assert "waiting for a person's approval" in pa_told(done.all_messages())["call_r"][0]
    assert agents.runs(key) == 0
