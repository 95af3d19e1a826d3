"""How a run's audit list is read (celery_tooleffect/store/chain.py), without a
server: names, bodies, the header, the MAC, and the checks on a list built
here the way prelude.lua builds it."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_tooleffect.store.chain import (
    CODES,
    Element,
    Header,
    canonical,
    check_chain,
    mac_matches,
    parse,
    read_name,
    seal,
)

KEY = b"k" * 32


def stored_name(name: str) -> str:
    """prelude.lua's stored_name."""
    if name in CODES:
        return CODES[name]
    if len(name) == 1 or name[:1] in ("=", "+"):
        return "=" + name
    return name


def element(previous_link: str, pairs: list[tuple[str, str]],
            added: tuple[tuple[str, str], ...] = ()) -> tuple[bytes, str]:
    """An element as prelude.lua stores it, and the link after it."""
    items = []
    for name, value in pairs:
        if name != "run_id":
            items += [stored_name(name).encode(), value.encode()]
    for name, value in added:
        items += [("+" + stored_name(name)).encode(), value.encode()]
    body = canonical(items)
    link = hashlib.sha1(previous_link.encode() + body).hexdigest()
    return hashlib.sha1(body).hexdigest()[:8].encode() + link[:8].encode() + body, link


def run(*events: list[tuple[str, str]], key: bytes | None = None) -> list[bytes]:
    """A run's list: header, then ``events`` (each sealed with ``key``)."""
    link, elements = "", []
    for pairs in events:
        if key is not None:
            flat = [part for pair in pairs for part in pair]
            pairs = [*pairs, ("mac", seal(key, "r", flat))]
        stored, link = element(link, pairs)
        elements.append(stored)
    return [f"te1 {len(events)} {link or '-'} 0 -".encode(), *elements]


EVENT = [("run_id", "r"), ("task_id", "t1"), ("tool", "x.y"), ("phase", "outcome"),
         ("status", "succeeded"), ("ts", "1.5"), ("t", "a detail named like a code"),
         ("=odd", "v"), ("+plus", "w")]


def test_names_are_stored_short_and_read_back_whole() -> None:
    stored, _ = element("", EVENT, added=(("phase", "late_outcome"),))
    parsed = Element.parse(1, stored)
    assert parsed.sent == [(name, value) for name, value in EVENT if name != "run_id"]
    assert parsed.added == [("phase", "late_outcome")]
    assert parsed.fields("r")["phase"] == "late_outcome"
    assert list(parsed.fields("r"))[:2] == ["run_id", "task_id"]
    assert read_name("=t") == ("t", False) and read_name("+p") == ("phase", True)
    assert read_name("+=+plus") == ("+plus", True)


@given(st.lists(st.tuples(st.binary(max_size=20), st.binary(max_size=20)), max_size=8))
def test_a_canonical_body_parses_back(pairs: list[tuple[bytes, bytes]]) -> None:
    body = canonical(part for pair in pairs for part in pair)
    assert parse(body) == [(n.decode("utf-8", "replace"), v.decode("utf-8", "replace"))
                           for n, v in pairs]


@pytest.mark.parametrize("body", [b"5:ab", b"x:ab", b"1:a", b"-1:"])
def test_a_body_that_is_not_canonical_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse(body)


def test_the_header() -> None:
    assert Header.parse(b"te1 6 abc 2 def") == Header(6, "abc", 2, "def")
    assert Header.parse(b"te1 1 - 0 -") == Header(1, "", 0, "")
    for raw in (None, b"", b"te2 1 - 0 -", b"te1 x - 0 -", b"1:t2:ab"):
        assert Header.parse(raw) is None


def test_the_mac_binds_the_run_and_every_sent_field_but_not_their_order() -> None:
    flat = ["task_id", "t1", "phase", "outcome"]
    mac = seal(KEY, "r", flat)
    assert len(mac) == 22
    assert mac_matches(KEY, "r", [("phase", "outcome"), ("task_id", "t1")], mac)
    assert not mac_matches(KEY, "other", [("task_id", "t1"), ("phase", "outcome")], mac)
    assert not mac_matches(KEY, "r", [("task_id", "t1"), ("phase", "failed")], mac)
    assert not mac_matches(b"x" * 32, "r", [("task_id", "t1"), ("phase", "outcome")], mac)


def test_check_chain_on_a_list_built_as_the_script_builds_it() -> None:
    one = [("task_id", "a"), ("phase", "intent")]
    two = [("task_id", "b"), ("phase", "outcome")]
    raw = run(one, two, key=KEY)
    check = check_chain("r", raw, key=KEY)
    assert check.intact and (check.events, check.keyed, check.head_seq) == (2, 2, 2)
    assert check_chain("r", raw).keyed == 0
    assert check_chain("r", [raw[0], raw[2], raw[1]]).problem == (
        "the event before it is missing or was altered")
    assert check_chain("r", raw[:-1]).problem == "newer events were deleted"
    assert check_chain("r", raw[1:]).problem == "the run's header is missing or was altered"
    assert check_chain("r", run(one, two), key=KEY).problem == (
        "event has no MAC: not stored by a holder of the audit key")
    assert check_chain("r", []).intact and check_chain("r", []).events == 0


def test_a_lone_surrogate_is_sealed_as_the_store_keeps_it() -> None:
    # The store's clients send text that is not UTF-8 escaped (connections.py):
    # an event sealed with a surrogate verifies from the escaped text read back.
    odd = "a\ud800b"
    mac = seal(KEY, odd, ["task_id", odd, "note", "\udcff"])
    assert mac_matches(KEY, "a\\ud800b", [("task_id", "a\\ud800b"), ("note", "\\udcff")], mac)
    stored, _ = element("", [("task_id", "t")])
    assert Element.parse(1, stored).fields(odd)["run_id"] == "a\\ud800b"
