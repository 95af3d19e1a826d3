"""The worked example of docs/testing.md, examples/test_agent_app.py, run as a
user runs it (its own pytest, the plugin enabled by the file): every example
tool crashed at every boundary ends as the table "How a task ends" (docs/guide.md) promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "test_agent_app.py"

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(900)


def test_the_example_apps_crash_matrix_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # examples.agent_app, for the workers too
    result = pytester.runpytest_subprocess(
        str(EXAMPLE), "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
        f"--tooleffect-redis-url={REDIS_URL}",
    )
    outcomes = result.parseoutcomes()
    # All passed (none failed, errored or skipped), and the whole matrix ran.
    assert result.ret == 0 and set(outcomes) == {"passed"} and outcomes["passed"] >= 32, \
        "\n".join(result.outlines[-60:])
