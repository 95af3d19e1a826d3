"""The agent's user approves a call through LangGraph's interrupt (issue 42,
item 2): a LangGraph ReAct agent with a fake chat model, the package's
LangChain tools and a real ``celery worker`` of ``tests.apps.agent_tools_app``
(``shop.wire``: the user approves, shown the account masked; ``shop.refund``:
an operator alone approves).

The graph's checkpoints are in an ``InMemorySaver``; a run resumed "in
another process" is resumed by new app, tool, model and graph objects whose
saver holds a copy of the first one's checkpoints (what a persistent
checkpointer gives an app), after the worker was killed and another started.
"""

from __future__ import annotations

import copy
import json
import uuid
import warnings
from typing import Any

import anyio
import pydantic
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from celery_tooleffect import Approvals, ApprovalState, AuditLog, call_task_id
from celery_tooleffect.agents import ToolCaller
from celery_tooleffect.agents.approvals import UserApprovals
from celery_tooleffect.agents.langchain import langchain_tools
from tests.agents.conftest import Agents
from tests.apps.agent_tools_app import build

pytestmark = pytest.mark.timeout(180)

ACCOUNT = "DE89370400440532013000"


class FakeToolModel(GenericFakeChatModel):
    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:  # the script knows its tools
        return self


def calling(tool: str, arguments: dict[str, Any], call_id: str) -> AIMessage:
    return AIMessage(content="", tool_calls=[
        {"name": tool, "args": arguments, "id": call_id, "type": "tool_call"}])


def agent(app: Any, saver: InMemorySaver, *replies: AIMessage) -> Any:
    """A ReAct agent whose model answers ``replies`` in turn."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from langgraph.prebuilt import create_react_agent

        return create_react_agent(FakeToolModel(messages=iter(replies)), langchain_tools(app),
                                  checkpointer=saver)


def run(graph: Any, given: Any, config: dict[str, Any]) -> dict[str, Any]:
    return dict(anyio.run(graph.ainvoke, given, config))


def restored(saver: InMemorySaver) -> InMemorySaver:
    """Another saver holding the same checkpoints (serialized already)."""
    again = InMemorySaver()
    for thread, spaces in saver.storage.items():
        again.storage[thread].update(copy.deepcopy(dict(spaces)))
    again.writes.update(copy.deepcopy(dict(saver.writes)))
    again.blobs.update(copy.deepcopy(dict(saver.blobs)))
    return again


def answer(call_id: str, state: dict[str, Any]) -> ToolMessage:
    [message] = [m for m in state["messages"]
                 if isinstance(m, ToolMessage) and m.tool_call_id == call_id]
    return message


def approval_events(app: Any, run_id: str, task_id: str) -> list[dict[str, Any]]:
    return [event for event in AuditLog(app).events(run_id)
            if event["task_id"] == task_id and event["phase"] == "approval"]


def resume(approved: bool, digest: str, by: str = "ana@example.com",
           reason: str = "") -> Command[Any]:
    return Command(resume={"approved": approved, "by": by, "reason": reason, "digest": digest})


def a_wire(key: str) -> dict[str, Any]:
    return {"key": key, "account": ACCOUNT, "cents": 500}


def test_a_paused_call_approved_after_a_worker_restart_runs_once(agents: Agents) -> None:
    first = agents.worker()
    app = build(agents.prefix)
    key, thread = uuid.uuid4().hex[:8], uuid.uuid4().hex
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    saver = InMemorySaver()
    graph = agent(app, saver, calling("shop_wire", a_wire(key), "call_w"), AIMessage("done"))

    state = run(graph, {"messages": [HumanMessage("wire 5.00")]}, config)
    [paused] = state["__interrupt__"]
    ask = paused.value
    task_id = call_task_id("call_w", thread)
    # What the person is shown: the tool's approval_view, never the account.
    assert ask["tool"] == "shop.wire" and ask["approver"] == "user"
    assert ask["shown"] == {"view": {"account": "****3000", "amount": "5.00"}}
    assert ask["task_id"] == task_id and ask["digest"] and "Approve shop.wire" in ask["question"]
    assert ACCOUNT not in json.dumps(ask)
    assert [i.value for i in graph.get_state(config).interrupts] == [ask]
    assert agents.runs(key) == 0 and Approvals(app).get(task_id) is None  # not published

    first.kill()
    agents.worker()
    app = build(agents.prefix)
    graph = agent(app, restored(saver), AIMessage("done"))
    state = run(graph, resume(True, ask["digest"]), config)

    said = answer("call_w", state)
    assert said.status == "success" and said.content == "wired 500 to ****3000 (1)"
    assert state["messages"][-1].content == "done" and "__interrupt__" not in state
    assert agents.runs(key) == 1
    [approved] = approval_events(app, thread, task_id)
    assert (approved["status"], approved["actor"], approved["via"], approved["shown_digest"]) \
        == ("approved", "ana@example.com", "langgraph", ask["digest"])


def test_a_rejection_reaches_the_model_and_nothing_runs(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    key, thread = uuid.uuid4().hex[:8], uuid.uuid4().hex
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    graph = agent(app, InMemorySaver(), calling("shop_wire", a_wire(key), "call_w"),
                  AIMessage("done"))
    [paused] = run(graph, {"messages": [HumanMessage("wire 5.00")]}, config)["__interrupt__"]

    state = run(graph, resume(False, paused.value["digest"], reason="wrong account"), config)

    said = answer("call_w", state)
    assert said.status == "error"
    assert "shop.wire was rejected" in said.content
    assert "rejected by ana@example.com: wrong account" in said.content
    assert "Nothing of it ran" in said.content
    assert state["messages"][-1].content == "done"
    assert agents.runs(key) == 0
    [rejected] = approval_events(app, thread, paused.value["task_id"])
    assert (rejected["status"], rejected["actor"], rejected["via"], rejected["reason"]) == (
        "rejected", "ana@example.com", "langgraph", "wrong account")


def test_a_resume_of_another_shape_or_digest_decides_and_runs_nothing(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    key, thread = uuid.uuid4().hex[:8], uuid.uuid4().hex
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    graph = agent(app, InMemorySaver(), calling("shop_wire", a_wire(key), "call_w"),
                  AIMessage("done"))
    [paused] = run(graph, {"messages": [HumanMessage("wire 5.00")]}, config)["__interrupt__"]
    task_id = paused.value["task_id"]

    # Not the documented shape: LangGraph refuses it; the interrupt still waits.
    for wrong in ({"approved": "yes", "by": "ana", "digest": paused.value["digest"]},
                  {"approved": True, "by": " ", "digest": paused.value["digest"]},
                  {"approved": True, "by": "ana"}, True):
        with pytest.raises(pydantic.ValidationError):
            run(graph, Command(resume=wrong), config)
        assert [i.id for i in graph.get_state(config).interrupts] == [paused.id]

    # Approved for what another digest showed: nothing decided, nothing published.
    state = run(graph, resume(True, "0" * 64), config)
    said = answer("call_w", state)
    assert said.status == "error" and "not those shown" in said.content
    assert "shop.wire was not called" in said.content
    users = UserApprovals(ToolCaller.for_app(app))
    assert users.state(task_id, thread) is ApprovalState.ABSENT
    assert approval_events(app, thread, task_id) == []
    assert agents.runs(key) == 0 and Approvals(app).get(task_id) is None


def test_a_decided_call_asked_again_is_not_decided_again_nor_run_again(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    key, thread = uuid.uuid4().hex[:8], uuid.uuid4().hex
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    saver = InMemorySaver()
    graph = agent(app, saver, calling("shop_wire", a_wire(key), "call_w"), AIMessage("done"))
    [paused] = run(graph, {"messages": [HumanMessage("wire 5.00")]}, config)["__interrupt__"]
    approve = resume(True, paused.value["digest"])
    ran = answer("call_w", run(graph, approve, config))
    assert ran.content == "wired 500 to ****3000 (1)" and agents.runs(key) == 1

    # The node re-run with the same resume, from the checkpoint that paused
    # (what a crash after the decision and a second resume amount to).
    [waiting] = [snapshot for snapshot in graph.get_state_history(config)
                 if snapshot.interrupts]
    replay = agent(app, saver, AIMessage("done again"))
    state = run(replay, approve, waiting.config)
    # The fork starts before the tool's answer: the tool ran again to give it.
    assert answer("call_w", state).content == ran.content
    assert state["messages"][-1].content == "done again" and "__interrupt__" not in state

    # A later turn of the thread whose model makes the same call again.
    again = agent(app, saver, calling("shop_wire", a_wire(key), "call_w"), AIMessage("ok"))
    state = run(again, {"messages": [HumanMessage("again")]}, config)
    assert "__interrupt__" not in state
    assert [m.content for m in state["messages"] if isinstance(m, ToolMessage)] == [
        ran.content, ran.content]

    assert agents.runs(key) == 1
    assert [(e["status"], e["actor"]) for e in approval_events(
        app, thread, paused.value["task_id"])] == [("approved", "ana@example.com")]


def test_a_call_an_operator_approves_does_not_pause_the_graph(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    key, thread = uuid.uuid4().hex[:8], uuid.uuid4().hex
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    graph = agent(app, InMemorySaver(),
                  calling("shop_refund", {"key": key, "cents": 700}, "call_r"),
                  AIMessage("done"))

    state = run(graph, {"messages": [HumanMessage("refund 7.00")]}, config)

    assert "__interrupt__" not in state and not graph.get_state(config).interrupts
    said = answer("call_r", state)
    assert said.status == "success"
    assert "shop.refund is waiting for a person's approval" in said.content
    parked = Approvals(app).get(call_task_id("call_r", thread))
    assert parked is not None and parked.state is ApprovalState.PENDING
    assert parked.approver == "operator" and agents.runs(key) == 0


def test_two_calls_of_one_step_pause_together_and_are_decided_each(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    keys, thread = (uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]), uuid.uuid4().hex
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    both = AIMessage(content="", tool_calls=[
        {"name": "shop_wire", "args": a_wire(keys[0]), "id": "call_a", "type": "tool_call"},
        {"name": "shop_wire", "args": a_wire(keys[1]), "id": "call_b", "type": "tool_call"}])
    graph = agent(app, InMemorySaver(), both, AIMessage("done"))
    paused = run(graph, {"messages": [HumanMessage("two wires")]}, config)["__interrupt__"]
    asks = {i.value["call_id"]: i for i in paused}
    assert sorted(asks) == ["call_a", "call_b"]

    # One resume value per interrupt, by its id (LangGraph's resume map).
    state = run(graph, Command(resume={
        asks[call].id: {"approved": call == "call_a", "by": "ana",
                        "digest": asks[call].value["digest"]} for call in asks}), config)

    assert answer("call_a", state).content == "wired 500 to ****3000 (1)"
    assert answer("call_b", state).status == "error"
    assert agents.runs(keys[0]) == 1 and agents.runs(keys[1]) == 0


def test_a_call_approved_by_both_waits_for_an_operator_after_its_user(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    key, thread = uuid.uuid4().hex[:8], uuid.uuid4().hex
    config: dict[str, Any] = {"configurable": {"thread_id": thread}}
    graph = agent(app, InMemorySaver(),
                  calling("shop_payout", {"key": key, "cents": 9_000}, "call_p"),
                  AIMessage("done"))
    [paused] = run(graph, {"messages": [HumanMessage("pay out")]}, config)["__interrupt__"]
    assert paused.value["approver"] == "both"
    assert "then an operator approves it too" in paused.value["question"]

    state = run(graph, resume(True, paused.value["digest"]), config)

    said = answer("call_p", state)
    assert said.status == "success"
    assert "approved by its user and is waiting for an operator" in said.content
    task_id = paused.value["task_id"]
    assert agents.runs(key) == 0
    assert Approvals(app).approve(task_id, by="olga").ok
    assert app.AsyncResult(task_id).get(timeout=60) == "paid out 9000 (1)"
    assert [(e["status"], e.get("actor"), e.get("via")) for e in approval_events(
        app, thread, task_id)] == [("user_approved", "ana@example.com", "langgraph"),
                                   ("requested", None, None), ("approved", "olga", "python")]


def test_a_tool_called_outside_a_graph_gets_its_call_parked_not_run(agents: Agents) -> None:
    agents.worker()
    app = build(agents.prefix)
    key = uuid.uuid4().hex[:8]
    [wire] = [tool for tool in langchain_tools(app) if tool.name == "shop_wire"]

    said = anyio.run(wire.ainvoke, {"type": "tool_call", "name": "shop_wire",
                                    "args": a_wire(key), "id": "call_x"})

    assert "shop.wire is waiting for its user's approval" in said.content
    parked = Approvals(app).get(said.artifact["task_id"])
    assert parked is not None and parked.state is ApprovalState.PENDING
    assert parked.approver == "user" and agents.runs(key) == 0
