"""The fault scenarios' summary lines, repeated at the end of the test session."""

from __future__ import annotations

from typing import Any

from tests.faults.scenario import REPORTED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if REPORTED:
        terminalreporter.section("fault scenarios")
        for line in REPORTED:
            terminalreporter.write_line(line)
