"""Every Python block of README.md and docs/*.md runs as shown, or says it is a
fragment.

A block's fence says which it is (mkdocs shows the title above the block)::

    ```python title="agent.py"          a module: saved under that name and run;
                                         with ``if __name__ == "__main__":`` it is
                                         run beside a real ``celery -A <module>
                                         worker`` of it, and importing it must
                                         send nothing
    ```python title="Fragment: ..."     a fragment (it says what it needs):
                                         compiled, not run
    ```python                            a script: run as it is

What runs, runs in a fresh interpreter against a ``redis-server`` of the test's
own, one per block: the default address in a block (``DOCS_ADDRESSES``) is
replaced with its address, nothing else is changed.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from celery_tooleffect.testing import RedisServer, redis_server, start_celery_worker
from tests.support import DOCS_ADDRESSES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?:python|py)(?P<info>[^\n]*)\n(?P<body>.*?)"
                   r"^(?P=indent)```[ \t]*$", re.M | re.S)
TITLE = re.compile(r'title="([^"]*)"')

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a document."""

    doc: str
    line: int
    title: str
    source: str

    @property
    def kind(self) -> str:
        if self.title.lower().startswith("fragment"):
            return "fragment"
        if self.title.endswith(".py"):
            return "module"
        return "script" if not self.title else "unknown"

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def _dedent(body: str, indent: str) -> str:
    return "".join(line[len(indent):] if line.startswith(indent) else line
                   for line in body.splitlines(keepends=True))


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            title = TITLE.search(match["info"])
            found.append(Block(str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1,
                               title[1] if title else "",
                               _dedent(match["body"], match["indent"])))
    return found


BLOCKS = blocks()
RUN = [block for block in BLOCKS if block.kind in ("module", "script")]


def test_every_block_is_a_module_a_script_or_a_marked_fragment() -> None:
    assert len(BLOCKS) >= 20 and any(block.doc == "README.md" for block in RUN)
    for block in BLOCKS:
        assert block.kind != "unknown", f"{block}: title {block.title!r}"
        # Fragments too are valid Python (an agent SDK's `await` included).
        compile(block.source, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the block's own: it starts empty, so nothing of
    another block is seen, and nothing is flushed."""
    # AOF fsynced on every write, as the docs ask of a store: the worker starts
    # without a word about it.
    with redis_server("--appendonly", "yes", "--appendfsync", "always") as started:
        yield started


def _python(arguments: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(folder)}
    return subprocess.run([sys.executable, *arguments], cwd=folder, env=env, text=True,
                          capture_output=True, timeout=120, check=False)


@pytest.mark.parametrize("block", RUN, ids=str)
def test_a_block_runs_as_shown(block: Block, server: RedisServer, tmp_path: Path) -> None:
    client = server.client()
    source = block.source
    for address in DOCS_ADDRESSES:
        source = source.replace(address, server.url)
    name = block.title if block.kind == "module" else "script.py"
    (tmp_path / name).write_text(source, encoding="utf-8")
    module = name.removesuffix(".py")
    if block.kind == "script" or 'if __name__ == "__main__":' not in source:
        ran = _python([name], tmp_path)
        assert ran.returncode == 0, f"{block}:\n{ran.stdout}\n{ran.stderr}"
        return

    # Importing the module (the worker, every `celery -A` command) sends nothing.
    imported = _python(["-c", f"import {module}"], tmp_path)
    assert imported.returncode == 0, imported.stderr
    listed = _python(["-m", "celery", "-A", module, "tooleffect", "dlq", "list"], tmp_path)
    assert listed.returncode == 0 and listed.stdout.strip() == "No dead letters match.", (
        listed.stdout + listed.stderr)
    assert _queued(client) == 0

    worker = start_celery_worker(module, tmp_path / "worker.log", queues="celery",
                                 root=tmp_path, ready_timeout=60)
    try:
        ran = _python([name], tmp_path)
    finally:
        worker.stop()
    assert ran.returncode == 0, f"{block}:\n{ran.stdout}\n{ran.stderr}\n{worker.output()}"
    warnings = [line for line in worker.output().splitlines() if "WARNING" in line]
    assert not warnings, warnings
    if block.doc == "README.md":
        lines = ran.stdout.splitlines()
        # Catalog, the invoice twice (sent once), audit events, no dead letter, no approval.
        assert lines[0] == "['usb-c cable 1m', 'usb-c cable 2m']"
        assert lines[1].startswith("INV-") and lines[2] == lines[1]
        assert int(lines[3]) >= 3 and lines[4:] == ["[]", "[]"], ran.stdout
        assert worker.output().count("agent.send_invoice[") >= 1
        invoices = [line for line in worker.output().splitlines()
                    if "agent.send_invoice[" in line and "succeeded" in line]
        assert len(invoices) == 1, worker.output()


def _queued(client: redis.Redis) -> int:
    return sum(int(client.llen(key)) for key in client.scan_iter(match="celery*")
               if client.type(key) == b"list")
