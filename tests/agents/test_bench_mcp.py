"""The MCP benchmark works: ``python -m bench.mcp_calls --smoke`` (a few calls
on each path, on a redis-server and workers of its own). Nothing is timed:
the program fails unless every call answered SUCCESS with its argument."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.agents.conftest import ROOT


def test_the_mcp_benchmark_runs_every_path(tmp_path: Path) -> None:
    figures = tmp_path / "mcp.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.mcp_calls", "--smoke", "--json", str(figures)],
        cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(figures.read_text())
    assert sorted(rows) == sorted(f"{path} / {effect}"
                                  for path in ("direct", "MCP stdio", "MCP HTTP")
                                  for effect in ("READ_ONLY", "NON_IDEMPOTENT_WRITE"))
    for row in rows.values():
        assert len(row["latencies"]) == 10 and len(row["rates"]) == 1
    assert "| MCP HTTP | NON_IDEMPOTENT_WRITE |" in done.stdout
