"""Plain-text tables for the CLI: aligned columns that fit the terminal.

What a table promises at any width (:func:`render`):

- an id and a task's name are never cut: the columns named in ``whole``
  (by default :data:`WHOLE`: ``TASK ID``, ``RUN ID``, ``ID``, ``TOOL``) print
  every cell in full;
- columns that are not ``optional`` are always there;
- the ``optional`` columns (listed least important first) are added, most
  important first, as long as they fit; one that does not fit is left out
  whole, never shown cut;
- the ``shrink`` columns (free text such as an exception's name) may be cut
  with an ellipsis, down to :data:`READABLE` characters, to make room;
- only when the columns that are always there cannot fit even so are their
  other cells cut further (down to :data:`MIN_WIDTH`); a line is wider than
  ``width`` only when even that cannot fit next to the whole cells, which
  are never cut.

``wide`` (the commands' ``--wide``) prints every column with every cell in
full, whatever the width. The width is ``$COLUMNS`` when set, else the
terminal's, else :data:`DEFAULT_WIDTH`, 80 (:func:`terminal_width`).
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .visible import escape

GAP = "  "
#: The width a cell of a ``shrink`` column may be cut to while any optional
#: column is still shown; narrower only when nothing else can give.
READABLE = 12
#: The narrowest any cut cell becomes (``dead_le…``, ``retries…``: still a hint).
MIN_WIDTH = 8
ELLIPSIS = "…"
#: The width of a table printed without a terminal and without ``$COLUMNS``.
DEFAULT_WIDTH = 80
#: Columns never cut: the ids an operator copies, and a task's name.
WHOLE = ("TASK ID", "RUN ID", "ID", "TOOL")
#: What a table that left columns out says under itself (``hint=True``).
WIDE_HINT = "--wide shows them"


def terminal_width(default: int = DEFAULT_WIDTH) -> int:
    """The width tables fit: ``$COLUMNS`` when set, else the terminal's, else
    ``default`` (80: what a table assumes without a terminal)."""
    return max(shutil.get_terminal_size((default, 24)).columns, 20)


def flat(value: object) -> str:
    """``value`` as one line: every run of whitespace one space, and every
    invisible or text-reordering character escaped (:func:`~.visible.escape`:
    ``\u202e``), so that a cell shows all it holds."""
    return " ".join(escape(part) for part in str(value).split())


def cut(value: str, width: int) -> str:
    """``value`` on one line, at most ``width`` characters (ending in … when cut)."""
    text = flat(value)
    if len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + ELLIPSIS if width > 0 else ""


@dataclass(frozen=True)
class Layout:
    """Which columns a table shows, and how wide each is: made once by
    :func:`layout`, then used for every line (``audit tail --follow`` prints
    rows that come later with the layout of the first ones)."""

    headers: list[str]
    #: The index in the full row of each column shown, in order.
    shown: list[int]
    widths: list[int]
    #: Which shown columns are never cut.
    whole: list[bool]
    #: The headers of the columns left out, in table order.
    hidden: list[str]

    def line(self, row: Sequence[str]) -> str:
        """One row (all the table's columns, in order), laid out: the columns
        shown, aligned; a whole cell wider than its column is printed in full."""
        cells = []
        for position, index in enumerate(self.shown):
            value = flat(row[index]) if index < len(row) else ""
            width = self.widths[position]
            cells.append(value.ljust(width) if self.whole[position] else
                         cut(value, width).ljust(width))
        return GAP.join(cells).rstrip()

    def heading(self) -> list[str]:
        """The header line and the rule under it."""
        return [self.line(self.headers),
                GAP.join("-" * width for width in self.widths)]

    def note(self, width: int) -> list[str]:
        """When columns were left out, lines (fitting ``width``) that name them
        and say that ``--wide`` shows them; else none."""
        if not self.hidden:
            return []
        return textwrap.wrap(f"Not shown: {', '.join(self.hidden)} ({WIDE_HINT}).",
                             width=width, break_on_hyphens=False)


def layout(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    shrink: Sequence[str] = (),
    optional: Sequence[str] = (),
    whole: Sequence[str] = WHOLE,
    wide: bool = False,
    expect: Mapping[str, int] | None = None,
) -> Layout:
    """How ``rows`` under ``headers`` fit ``width`` (see the module docs).

    ``expect``: widths to plan for as if a row had them (the cells of rows
    printed later, e.g. 36 for a task id).
    """
    headers = list(headers)
    width = width or terminal_width()
    cells = [[flat(cell) for cell in row] for row in rows]
    natural = [max([len(header), (expect or {}).get(header, 0),
                    *(len(row[i]) for row in cells if i < len(row))])
               for i, header in enumerate(headers)]
    kept = [header in whole for header in headers]
    if wide:
        return Layout(headers, list(range(len(headers))), natural, kept, [])
    cuttable = [not kept[i] and header in shrink for i, header in enumerate(headers)]
    least = [min(natural[i], READABLE) if cuttable[i] else natural[i]
             for i in range(len(headers))]

    def needs(columns: Sequence[int]) -> int:
        return sum(least[i] for i in columns) + len(GAP) * max(len(columns) - 1, 0)

    chosen = [i for i, header in enumerate(headers) if header not in optional]
    # The optional columns, most important first, each while it fits.
    for header in reversed([name for name in optional if name in headers]):
        index = headers.index(header)
        if needs([*chosen, index]) <= width:
            chosen.append(index)
    chosen.sort()
    widths = {i: natural[i] for i in chosen}

    def total() -> int:
        return sum(widths.values()) + len(GAP) * max(len(widths) - 1, 0)

    for floor, may_cut in ((READABLE, cuttable), (MIN_WIDTH, [not k for k in kept])):
        while total() > width:
            candidates = [i for i in chosen if may_cut[i] and widths[i] > min(floor, natural[i])]
            if not candidates:
                break
            widest = max(candidates, key=lambda i: widths[i])
            widths[widest] = max(min(floor, natural[widest]), widths[widest] - (total() - width))
    return Layout(
        headers, chosen, [widths[i] for i in chosen], [kept[i] for i in chosen],
        [header for i, header in enumerate(headers) if i not in widths],
    )


def render(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    shrink: Sequence[str] = (),
    optional: Sequence[str] = (),
    whole: Sequence[str] = WHOLE,
    wide: bool = False,
    hint: bool = False,
) -> str:
    """``rows`` under ``headers``, aligned, fitting ``width`` (default: the
    terminal's) as the module docs say; ``wide``: every column, nothing cut.
    ``hint``: when columns were left out, the last lines (fitting ``width``)
    name them and say that ``--wide`` shows them."""
    width = width or terminal_width()
    laid = layout(headers, rows, width=width, shrink=shrink, optional=optional, whole=whole,
                  wide=wide)
    out = [*laid.heading(), *(laid.line(row) for row in rows)]
    if hint:
        out.extend(laid.note(width))
    return "\n".join(out)


def key_values(pairs: Sequence[tuple[str, str]], *, width: int | None = None) -> str:
    """``name  value`` lines, names aligned; a value longer than the line goes
    on under itself, broken between words only (an id is never cut)."""
    width = width or terminal_width()
    if not pairs:
        return ""
    name_width = max(len(name) for name, _ in pairs)
    indent = " " * (name_width + len(GAP))
    lines = []
    for name, value in pairs:
        text = flat(value)
        wrapped = textwrap.wrap(text, width=max(width - len(indent), 20),
                                break_long_words=False, break_on_hyphens=False) or [""]
        lines.append(f"{name.ljust(name_width)}{GAP}{wrapped[0]}".rstrip())
        lines.extend(f"{indent}{part}" for part in wrapped[1:])
    return "\n".join(lines)
