"""The CLI's tables (celery_tooleffect/admin/table.py): what fits a width, and
what is never cut."""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_tooleffect.admin.table import (
    DEFAULT_WIDTH,
    ELLIPSIS,
    key_values,
    layout,
    render,
    terminal_width,
)

PROPERTIES = settings(max_examples=200, deadline=None, database=None)

HEADERS = ["TASK ID", "STORED (UTC)", "QUEUE", "TOOL", "EFFECT", "REASON", "CLASS", "TRY",
           "EXCEPTION"]
SHRINK = ["EXCEPTION", "QUEUE"]
OPTIONAL = ["EXCEPTION", "TRY", "CLASS", "QUEUE", "STORED (UTC)", "REASON", "EFFECT"]


def letter_row(tool: str, exception: str = "ValueError (body completed)") -> list[str]:
    return [str(uuid.uuid4()), "2026-12-03 09:56:55Z", "tools", tool, "non_idempotent_write",
            "retries_exhausted", "client_error", "3", exception]


def test_at_80_columns_the_task_id_and_the_tool_are_whole_and_others_left_out() -> None:
    rows = [letter_row("billing.tools.send_invoice_email"), letter_row("app.search")]
    text = render(HEADERS, rows, width=80, shrink=SHRINK, optional=OPTIONAL, hint=True)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    # 36 + 2 + 32: no room for the effect (20) or the reason; the queue fits.
    assert lines[0].split() == ["TASK", "ID", "QUEUE", "TOOL"]
    for row, line in zip(rows, lines[2:4], strict=True):
        assert line.split() == [row[0], "tools", row[3]]  # whole, never "app.s…"
    assert ELLIPSIS not in "\n".join(lines[:4])
    # What was left out is named, and how to see it.
    assert " ".join(lines[4:]) == ("Not shown: STORED (UTC), EFFECT, REASON, CLASS, TRY, "
                                   "EXCEPTION (--wide shows them).")


def test_optional_columns_are_added_most_important_first_while_they_fit() -> None:
    rows = [letter_row("app.search")]
    laid = layout(HEADERS, rows, width=100, shrink=SHRINK, optional=OPTIONAL)
    shown = [HEADERS[i] for i in laid.shown]
    # EFFECT and REASON (the most important) fit, STORED does not; QUEUE, less
    # important but narrow, still fits after it; the columns keep their order.
    assert shown == ["TASK ID", "QUEUE", "TOOL", "EFFECT", "REASON"]
    assert laid.hidden == ["STORED (UTC)", "CLASS", "TRY", "EXCEPTION"]
    assert len(laid.line(rows[0])) <= 100
    # A free-text column is cut to make room before it is left out.
    wider = layout(HEADERS, rows, width=160, shrink=SHRINK, optional=OPTIONAL)
    assert wider.hidden == []
    line = wider.line(rows[0])
    assert len(line) <= 160 and line.endswith(ELLIPSIS) and "ValueError (b" in line


def test_wide_prints_every_column_with_nothing_cut() -> None:
    rows = [letter_row("billing.tools.send_invoice_email", "X" * 200)]
    text = render(HEADERS, rows, width=80, shrink=SHRINK, optional=OPTIONAL, wide=True,
                  hint=True)
    lines = text.splitlines()
    assert len(lines) == 3  # no hint: nothing left out
    assert lines[0].split()[0:3] == ["TASK", "ID", "STORED"]
    assert "X" * 200 in lines[2] and ELLIPSIS not in text
    for cell in rows[0]:
        assert cell in lines[2]


def test_an_id_is_never_cut_even_when_it_cannot_fit() -> None:
    long_id = "run-" + "x" * 100
    text = render(["RUN ID", "TOOL", "STATUS"], [[long_id, "tools.charge", "succeeded"]],
                  width=40)
    assert long_id in text and "tools.charge" in text
    # What can give does: the status is cut, never the id.
    assert text.splitlines()[2].split()[:2] == [long_id, "tools.charge"]


@PROPERTIES
@given(
    ids=st.lists(st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1,
                         max_size=40), min_size=1, max_size=5),
    tools=st.lists(st.from_regex(r"[a-z]{1,8}(\.[a-z_]{1,12}){0,2}", fullmatch=True),
                   min_size=5, max_size=5),
    others=st.lists(st.text(min_size=0, max_size=60), min_size=7, max_size=7),
    width=st.integers(20, 200),
)
def test_whole_cells_appear_in_full_and_lines_fit_when_the_whole_columns_do(
    ids: list[str], tools: list[str], others: list[str], width: int,
) -> None:
    rows = [[task_id, *others[:2], tools[i], *others[2:]] for i, task_id in enumerate(ids)]
    text = render(HEADERS, rows, width=width, shrink=SHRINK, optional=OPTIONAL)
    lines = text.splitlines()
    for row, line in zip(rows, lines[2:], strict=True):
        assert row[0] in line and row[3] in line
    whole = max(len("TASK ID"), *(len(r[0]) for r in rows)) + 2 + max(
        len("TOOL"), *(len(r[3]) for r in rows))
    # The columns that are always there (EFFECT is optional here: all but the
    # whole ones give) fit: then so does every line.
    if whole <= width:
        assert all(len(line) <= width for line in lines), text


def test_key_values_wrap_long_values_and_never_cut_an_id() -> None:
    task_id = str(uuid.uuid4())
    text = key_values([("task id", task_id), ("refusal", "word " * 40)], width=50)
    lines = text.splitlines()
    assert lines[0] == f"task id  {task_id}"
    assert all(len(line) <= 50 for line in lines)
    assert all(line.startswith(" " * 9) for line in lines[2:])  # under the value
    assert " ".join(" ".join(line.split()) for line in lines[1:]) == (
        "refusal " + ("word " * 40).strip())


def test_without_a_terminal_the_width_is_columns_else_80(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_terminal(fd: int = 1) -> os.terminal_size:
        raise OSError("not a terminal")

    monkeypatch.setattr(os, "get_terminal_size", no_terminal)
    monkeypatch.setenv("COLUMNS", "133")
    assert terminal_width() == 133
    monkeypatch.delenv("COLUMNS")
    assert terminal_width() == DEFAULT_WIDTH == 80


def test_dlq_list_keeps_reason_class_and_exception_at_80_columns() -> None:
    """What an operator reads first stays; the tool is left out whole when it
    does not fit beside them, named under the table."""
    from celery_tooleffect.admin.cli.dlq import letter_table

    letters = [{"task_id": str(uuid.uuid4()), "dead_lettered_at": 1_764_900_000.0,
                "queue": "tools", "name": "billing.tools.send_invoice_email",
                "effect": "non_idempotent_write", "reason": "retries_exhausted",
                "failure_class": failure_class, "attempts": 4,
                "exception_type": "ConnectionRefusedError", "body_completed": False,
                "late_outcomes": 0} for failure_class in ("connection", "not_retryable")]
    lines = letter_table(letters, width=80).splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].split()[:4] == ["TASK", "ID", "REASON", "CLASS"]
    for letter, line in zip(letters, lines[2:4], strict=True):
        cells = line.split()
        assert cells[:3] == [letter["task_id"], "retries_exhausted", letter["failure_class"]]
        assert cells[3].startswith("Connect")
    assert "TOOL" in lines[4]
    roomy = letter_table(letters, width=120).splitlines()
    assert "billing.tools.send_invoice_email" in roomy[2].split()


def test_audit_show_keeps_the_time_at_80_columns() -> None:
    """A run's events of one day show their time as HH:MM:SS under the date."""
    from celery_tooleffect.admin.cli.audit import event_table

    events = [{"seq": str(seq), "ts": str(1_764_900_000 + seq), "task_id": str(uuid.uuid4()),
               "tool": "tools.send_invoice", "phase": phase, "status": status,
               "attempt": "1", "worker": "celery@host"}
              for seq, (phase, status) in enumerate([("intent", "started"),
                                                     ("dead_lettered", "retries_exhausted")])]
    lines = event_table(events, width=80).splitlines()
    assert lines[0] == "2025-12-05 (UTC)" and all(len(line) <= 80 for line in lines)
    assert lines[4].split()[-4:] == ["02:00:01", events[1]["task_id"], "dead_lettered",
                                     "retries_exhausted"]
    # Events of two days show the whole time.
    events[1]["ts"] = str(1_764_900_000 + 86_400)
    assert "2025-12-06 02:00:00Z" in event_table(events, width=120)
