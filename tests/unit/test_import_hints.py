"""An agent integration imported without its extra says which extra to install.

Each import runs in a fresh interpreter in which the SDK's module is absent
(``sys.modules[name] = None`` makes importing it fail as a missing module does).
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("absent", "module", "told"), [
    ("agents", "openai_agents", "pip install 'celery-tooleffect[openai-agents]'"),
    ("langchain_core", "langchain", "pip install 'celery-tooleffect[langchain]'"),
    ("pydantic_ai", "pydantic_ai", "pip install 'celery-tooleffect[pydantic-ai]'"),
    ("anyio", "langchain", "pip install 'celery-tooleffect[mcp]' (or the extra of your "
                           "agent SDK: [openai-agents], [langchain] or [pydantic-ai])"),
    ("pydantic", "schema", "pip install 'celery-tooleffect[mcp]'"),
])
def test_an_adapter_without_its_sdk_says_which_extra_installs_it(
        absent: str, module: str, told: str) -> None:
    ran = subprocess.run(
        [sys.executable, "-c",
         f"import sys; sys.modules[{absent!r}] = None\n"
         f"import celery_tooleffect.agents.{module}"],
        capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 1
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: celery_tooleffect.agents.")
    assert f"needs '{absent}" in last
    assert told in last
