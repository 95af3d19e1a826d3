"""What operators are shown of text: nothing invisible or text-reordering
(celery_tooleffect/admin/visible.py), and the same values underneath."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.admin.approvals import ShownArguments
from celery_tooleffect.admin.table import flat
from celery_tooleffect.admin.visible import escape, hidden, invisible, visible_json

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, database=None)
@given(JSON_VALUES, st.sampled_from([None, 2]))
def test_visible_json_is_the_same_value_with_nothing_hidden_in_its_text(
        value: Any, indent: int | None) -> None:
    text = visible_json(value, indent=indent)
    assert json.loads(text) == value
    assert not any(hidden(char) and char != "\n" for char in text)


def test_spoofing_characters_are_escaped_and_named() -> None:
    value = {"amount": "\u202e0001", "to": "acct\u200b42", "space": "1\u00a0000",
             "tag": "\U000e0041", "café": "👍", "typed": "\\u202e", "lines": "a\nb"}
    text = visible_json(value)
    assert '"amount": "\\u202e0001"' in text and '"to": "acct\\u200b42"' in text
    assert '"space": "1\\u00a0000"' in text and '"tag": "\\udb40\\udc41"' in text
    # Visible text stays itself; a typed backslash stays distinguishable.
    assert '"café": "👍"' in text and '"typed": "\\\\u202e"' in text
    assert invisible(value) == ["U+00A0 NO-BREAK SPACE", "U+200B ZERO WIDTH SPACE",
                                "U+202E RIGHT-TO-LEFT OVERRIDE",
                                "U+E0041 TAG LATIN CAPITAL LETTER A"]
    assert invisible({"plain": "text\twith\nbreaks", "é": ["ü"]}) == []
    assert escape("pay \u202e0001\u2066") == "pay \\u202e0001\\u2066"
    assert escape("\U000e0041") == "\\U000e0041"
    # A table cell: one line, hidden characters escaped.
    assert flat("a\u202eb\n c") == "a\\u202eb c"


def test_the_digest_is_over_the_values_and_the_api_names_what_is_hidden() -> None:
    plain = ShownArguments(args=["0001"], kwargs={})
    spoofed = ShownArguments(args=["\u202e1000"], kwargs={})
    canonical = json.dumps({"args": ["\u202e1000"], "kwargs": {}, "problem": None},
                           sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert spoofed.digest == hashlib.sha256(canonical.encode()).hexdigest() != plain.digest
    assert spoofed.to_dict()["args"] == ["\u202e1000"]
    assert spoofed.to_dict()["invisible"] == ["U+202E RIGHT-TO-LEFT OVERRIDE"]
    assert plain.to_dict()["invisible"] == []
    assert ShownArguments(view={"card\u200b": "x"}).invisible == ["U+200B ZERO WIDTH SPACE"]
