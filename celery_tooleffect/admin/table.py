"""Plain-text tables for the CLI: aligned columns that fit the terminal.

A table never prints a line wider than ``width``: when the columns do not fit,
the columns named as shrinkable are narrowed (longest first) down to
:data:`MIN_WIDTH`, and their cells are cut with an ellipsis; then the columns
named as optional are left out, in the order given; if that is still not
enough, every line is cut at ``width``. Columns in neither list (such as a
task id an operator copies) are printed whole as long as anything else can give.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

GAP = "  "
MIN_WIDTH = 6
ELLIPSIS = "…"


def terminal_width(default: int = 120) -> int:
    """The terminal's width in columns (``$COLUMNS`` or the tty's, else ``default``)."""
    return max(shutil.get_terminal_size((default, 24)).columns, 20)


def cut(value: str, width: int) -> str:
    """``value`` on one line, at most ``width`` characters (ending in … when cut)."""
    flat = " ".join(str(value).split())
    if len(flat) <= width:
        return flat
    return flat[: max(width - 1, 0)] + ELLIPSIS if width > 0 else ""


def clip(line: str, width: int) -> str:
    """``line`` cut at ``width`` characters (ending in … when cut), spacing kept."""
    return line if len(line) <= width else line[: max(width - 1, 0)] + ELLIPSIS


def render(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    shrink: Sequence[str] = (),
    optional: Sequence[str] = (),
) -> str:
    """``rows`` under ``headers``, aligned, fitting ``width`` (default: the terminal's)."""
    width = width or terminal_width()
    headers = list(headers)
    cells = [[" ".join(str(cell).split()) for cell in row] for row in rows]
    natural = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    minimum = [
        min(natural[i], MIN_WIDTH) if header in shrink else natural[i]
        for i, header in enumerate(headers)
    ]
    for name in optional:
        if sum(minimum) + len(GAP) * (len(minimum) - 1) <= width or name not in headers:
            continue
        index = headers.index(name)
        del headers[index], minimum[index]
        for row in cells:
            del row[index]
    widths = [
        max([len(header), *(len(row[i]) for row in cells)]) for i, header in enumerate(headers)
    ]
    shrinkable = [headers.index(name) for name in shrink if name in headers]

    def total() -> int:
        return sum(widths) + len(GAP) * (len(widths) - 1)

    while total() > width and shrinkable:
        widest = max(shrinkable, key=lambda i: widths[i])
        if widths[widest] <= MIN_WIDTH:
            break
        widths[widest] = max(MIN_WIDTH, widths[widest] - (total() - width))

    def line(values: Sequence[str]) -> str:
        text = GAP.join(cut(value, widths[i]).ljust(widths[i]) for i, value in enumerate(values))
        return clip(text.rstrip(), width)

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def key_values(pairs: Sequence[tuple[str, str]], *, width: int | None = None) -> str:
    """``name  value`` lines, names aligned, each line fitting ``width``."""
    width = width or terminal_width()
    if not pairs:
        return ""
    name_width = max(len(name) for name, _ in pairs)
    return "\n".join(
        clip(f"{name.ljust(name_width)}  {' '.join(str(value).split())}", width)
        for name, value in pairs
    )
