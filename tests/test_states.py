"""The journal's state machine: one set of names for Python and the Lua scripts."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from celery_tooleffect.effect import ToolEffect
from celery_tooleffect.store import states
from celery_tooleffect.store.states import Ending, JournalState, Verdict

SCRIPTS = resources.files("celery_tooleffect.store") / "scripts"

#: Where a Lua script names a journal state: compared with or assigned to the
#: entry's state, its default when the entry is absent, or written to its
#: 'state' field.
STATE_PATTERNS = (
    r"\b(?:state|current\[1\])\s*(?:==|~=|=)\s*'([^']*)'",
    r"\bcurrent\[1\]\s+or\s+'([^']*)'",
    r"'HSET',\s*[^,]+,\s*'state',\s*'([^']*)'",
    r"status\s*=\s*'([^']*)'.*duplicate_ignored|duplicate_ignored.*status\s*=\s*'([^']*)'",
)
EFFECT_PATTERN = r"\beffect\s*(?:==|~=)\s*'([^']*)'"
COUNTER_PATTERN = r"'(ended_[a-z_]*)'"


def lua_sources() -> dict[str, str]:
    return {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in SCRIPTS.iterdir()
        if entry.name.endswith(".lua")
    }


def code_lines(source: str) -> str:
    """The script without its comments (headers describe, code decides)."""
    return "\n".join(line.split("--", 1)[0] for line in source.splitlines())


def literals(pattern: str, source: str) -> set[str]:
    found: set[str] = set()
    for match in re.finditer(pattern, code_lines(source)):
        found.update(group for group in match.groups() if group)
    return found


def test_every_state_literal_in_the_scripts_is_a_journal_state() -> None:
    values = {state.value for state in JournalState}
    seen: set[str] = set()
    for name, source in lua_sources().items():
        for pattern in STATE_PATTERNS:
            found = literals(pattern, source)
            assert found <= values, f"{name}: unknown journal state(s) {found - values}"
            seen |= found
    # The scripts decide on these; a rename on one side only fails here.
    assert {"absent", "running", "succeeded", "dead_lettered", "dead_lettering",
            "interrupted", "not_run", "replayed"} <= seen


def test_every_effect_literal_in_the_scripts_is_a_tool_effect() -> None:
    values = {effect.value for effect in ToolEffect}
    seen: set[str] = set()
    for name, source in lua_sources().items():
        found = literals(EFFECT_PATTERN, source)
        assert found <= values, f"{name}: unknown effect(s) {found - values}"
        seen |= found
    assert seen == {ToolEffect.NON_IDEMPOTENT_WRITE.value}


def test_every_verdict_begin_attempt_returns_is_a_verdict() -> None:
    source = code_lines(lua_sources()["begin_attempt.lua"])
    # Every answer goes through the script's reply(verdict, ...).
    returned = set(re.findall(r"return\s*reply\(\s*'([^']*)'", source))
    assert returned == {verdict.value for verdict in Verdict}


def test_every_ending_counter_in_the_scripts_is_an_ending() -> None:
    counters = {ending.counter for ending in Ending}
    for name, source in lua_sources().items():
        found = literals(COUNTER_PATTERN, source)
        assert found <= counters, f"{name}: unknown counter(s) {found - counters}"


@pytest.mark.parametrize("target", list(states.TRANSITIONS))
def test_transitions_name_only_journal_states(target: JournalState) -> None:
    sources = states.TRANSITIONS[target]
    assert sources and all(isinstance(state, JournalState) for state in sources)


def test_every_state_is_reachable_and_drawn_in_the_diagram() -> None:
    reachable = set(states.TRANSITIONS) | {JournalState.ABSENT}
    assert reachable == set(JournalState)
    diagram = states.__doc__ or ""
    for state in JournalState:
        assert re.search(rf"\b{state.value}\b", diagram), f"{state.value} not in the diagram"


def test_settled_states_are_left_only_by_a_replay_or_a_reconciliation() -> None:
    for target, sources in states.TRANSITIONS.items():
        if target is not JournalState.REPLAYED:
            assert not sources & {JournalState.SUCCEEDED, JournalState.NOT_RUN}, target
    assert JournalState.DEAD_LETTERED not in states.DEAD_LETTER_FROM


def test_the_scripts_receive_allowed_states_as_values() -> None:
    assert states.allowed_argument(states.SUCCEED_FROM) == "absent running"


# -- the approval machine ----------------------------------------------------------


def test_approval_scripts_take_their_states_as_arguments() -> None:
    sources = lua_sources()
    for name in ("approval_request.lua", "approval_transition.lua"):
        code = code_lines(sources[name])
        # No state is spelled in the code but 'absent' (no record): the
        # states come from states.py as arguments, or from the record itself.
        assert set(re.findall(r"'([a-z_]+)'", code)) <= {
            "absent", "state", "ok", "exists", "adopted", "refused", "message",
        } | {word for word in re.findall(r"'([A-Z]+)'", code)}, name
    assert states.approval_argument(states.DECIDE_FROM) == "pending user_approved"
    assert states.approval_argument(states.END_REFUSED_FROM) == "expired rejected"


def test_every_approval_state_is_reachable_and_drawn_in_the_diagram() -> None:
    reachable = set(states.APPROVAL_TRANSITIONS) | {states.ApprovalState.ABSENT}
    assert reachable == set(states.ApprovalState)
    diagram = states.__doc__ or ""
    for state in states.ApprovalState:
        assert re.search(rf"\b{state.value}\b", diagram), f"{state.value} not in the diagram"


def test_a_decision_is_taken_once() -> None:
    A = states.ApprovalState
    decided = {A.APPROVED, A.REJECTED, A.EXPIRED, A.ENDED}
    # Only a call waiting for a decision is decided; no decided call is again.
    for target in (A.USER_APPROVED, A.APPROVED, A.REJECTED, A.EXPIRED):
        assert not states.APPROVAL_TRANSITIONS[target] & decided, target
    assert {A.PENDING, A.USER_APPROVED} == states.DECIDE_FROM
    assert not states.REFUSED & {A.APPROVED, A.PENDING, A.USER_APPROVED}
