"""A griffe extension for the API reference (docs/api.md, mkdocs.yml).

The package's docstrings are written for a reader of the source, with Sphinx's
cross-reference roles (``:class:`~.testing.ToolHarness```) and reST's literal
block marker (``Example::``). mkdocstrings renders docstrings as Markdown,
where a role would show as ``:class:`` in front of the name. This turns each
role into the name as code (``~`` keeps the last dotted part, as Sphinx does)
and ``text::`` into ``text:``; the indented block after it is already a code
block in Markdown, and double backticks already make code. reST's escaped
space after inline code (a backslash and a space right after the closing
backticks, as in a plural) is dropped.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: ``:class:`target``` or ``:py:meth:`title <target>```.
ROLE = re.compile(r":(?:py:)?(?:class|data|mod|func|meth|attr|exc|obj|const):`([^`]+)`")
#: A paragraph's last ``::`` (reST's "a literal block follows").
LITERAL_MARKER = re.compile(r"(\S)::$|^\s*::$", re.MULTILINE)
#: reST's escaped space right after inline code.
ESCAPED_SPACE = re.compile(r"`\\ ")


def _role(match: re.Match[str]) -> str:
    text = match.group(1).strip()
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", text)
    if titled:
        return f"`{titled.group(1)}`"
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def _literal(match: re.Match[str]) -> str:
    return f"{match.group(1)}:" if match.group(1) else ""


def markdown(docstring: str) -> str:
    """The docstring with its reST roles and literal markers as Markdown."""
    docstring = ESCAPED_SPACE.sub("`", ROLE.sub(_role, docstring))
    return LITERAL_MARKER.sub(_literal, docstring)


class RestRoles(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`markdown`."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        # The top package itself, which gets no on_object.
        self.on_object(obj=pkg)

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
