"""Text shown to operators with nothing hidden: the characters that are
invisible or change how the text around them reads (a right-to-left override
U+202E, zero-width spaces and joiners, other control and format characters,
spaces other than U+0020) are shown escaped, ``\\u202e``.

An approver reads a call's arguments before deciding; ``"amount": "‮0001"``
(with U+202E before the digits) reads as 1000 where the value is "1000" reversed,
and a zero-width space makes two account numbers look the same. So the
approval pages, the CLI (``approvals show`` and ``list``, ``dlq show``, every
table cell) and the API's ``shown.invisible`` make such characters visible.

- :func:`visible_json`: a value as JSON in which each such character is a
  JSON escape. JSON already escapes a backslash (``\\\\``), so ``\\u202e`` in
  what is shown is always the character, never six typed ones;
- :func:`escape`: plain text (a table cell, a reason) with each such
  character escaped (there a typed ``\\u202e`` looks the same: arguments are
  shown as JSON for that reason);
- :func:`invisible`: which such characters a value holds, named (``U+202E
  RIGHT-TO-LEFT OVERRIDE``): what the pages and the CLI warn of, and the API's
  ``shown.invisible``.

What is decided is unchanged: the digest of what is shown
(:attr:`~celery_tooleffect.admin.approvals.ShownArguments.digest`) is over the
values themselves, and their escaped form is a function of them.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator, Mapping
from typing import Any

#: Unicode categories shown escaped: controls (Cc), format characters (Cf:
#: the bidirectional controls, zero-width spaces and joiners, soft hyphen,
#: byte order mark, tags), surrogates, private use, line and paragraph
#: separators.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})
#: Characters that show as nothing though their category says a letter (Hangul
#: fillers, the braille blank).
BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


#: Controls JSON writes as ``\t``, ``\n``, ``\r``: visible as such, never warned of.
_SHOWN_WHITESPACE = frozenset("\t\n\r")


def hidden(char: str) -> bool:
    """Whether ``char`` is shown escaped: invisible, or changing how the text
    around it reads (see :data:`HIDDEN_CATEGORIES`; every space but U+0020)."""
    if char == " ":
        return False
    category = unicodedata.category(char)
    return category in HIDDEN_CATEGORIES or category == "Zs" or char in BLANK_LETTERS


def _json_escape(char: str) -> str:
    point = ord(char)
    if point <= 0xFFFF:
        return f"\\u{point:04x}"
    point -= 0x10000  # a JSON escape of an astral character is a surrogate pair
    return f"\\u{0xD800 + (point >> 10):04x}\\u{0xDC00 + (point & 0x3FF):04x}"


def escape(text: str) -> str:
    """``text`` with each hidden character escaped (``\\u202e``, ``\\U000e0041``)."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(
        (f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}")
        if hidden(char) else char
        for char in text
    )


def visible_json(value: Any, *, indent: int | None = None, sort_keys: bool = True) -> str:
    """``value`` as JSON (non-ASCII text as itself), each hidden character a
    JSON escape: the same JSON value, with nothing invisible in its text."""
    text = json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys,
                      default=str)
    # DEL (U+007F) is ASCII and a control, and the one json.dumps leaves as is.
    if text.isascii() and "\x7f" not in text:
        return text
    # Outside strings JSON is ASCII (an indent's line breaks: kept); inside
    # them, C0 controls are escaped already and an escape is the same character.
    return "".join(_json_escape(char) if hidden(char) and char not in _SHOWN_WHITESPACE
                   else char for char in text)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def invisible(value: Any) -> list[str]:
    """The hidden characters in ``value``'s strings (keys included), each once,
    in code point order: ``["U+202E RIGHT-TO-LEFT OVERRIDE"]``."""
    found = {char for text in _strings(value) if not text.isascii() or not text.isprintable()
             for char in text if hidden(char) and char not in _SHOWN_WHITESPACE}
    return [f"U+{ord(char):04X} {unicodedata.name(char, 'control character')}"
            for char in sorted(found)]


def warning(found: list[str]) -> str:
    """What a page or the CLI says above arguments that hold hidden characters."""
    return (f"the arguments hold {len(found)} kind(s) of invisible or text-reordering "
            f"character ({', '.join(found)}): each is shown escaped (\\u202e), as "
            "JSON writes it; read the values with that in mind")
