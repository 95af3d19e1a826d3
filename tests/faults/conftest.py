"""The fault scenarios' summary lines travel with their test's report.

:meth:`tests.faults.scenario.FaultRun.report` keeps each line in
:data:`~tests.faults.scenario.REPORTED`; here the lines a test added go into its
report's ``user_properties`` (:data:`tests.conftest.FAULT_LINE`), which
pytest-xdist sends from the worker to the controller, and tests/conftest.py
repeats them at the end of the session (this conftest is not loaded by an
xdist controller, which collects nothing).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import FAULT_LINE
from tests.faults.scenario import REPORTED

#: How many lines of REPORTED are in a report already (this process's).
_shipped = 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> None:
    global _shipped
    item.user_properties.extend((FAULT_LINE, line) for line in REPORTED[_shipped:])
    _shipped = len(REPORTED)
