"""Every warning a worker logs at start names its section of docs/operations.md
("Start-up warnings"), and that section exists."""

from __future__ import annotations

import ast
import re
import unicodedata
from pathlib import Path

import celery_tooleffect

PACKAGE = Path(celery_tooleffect.__file__).parent
OPERATIONS = PACKAGE.parent / "docs" / "operations.md"
#: The modules whose warnings a worker logs at start (and the watches they start).
MODULES = ["worker/startup.py", "worker/eviction.py", "worker/replication.py"]
REFERENCE = re.compile(r"see docs/operations\.md#([a-z0-9-]+)")


def slug(title: str) -> str:
    """A heading's anchor, as mkdocs' toc (Python-Markdown's ``slugify``) makes it."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def startup_sections() -> set[str]:
    """The anchors of the ``###`` sections under ``## Start-up warnings``."""
    text = OPERATIONS.read_text(encoding="utf-8")
    section = text.split("\n## Start-up warnings\n", 1)[1].split("\n## ", 1)[0]
    return {slug(title) for title in re.findall(r"^### (.+)$", section, flags=re.MULTILINE)}


def warnings_in(module: str) -> list[tuple[int, str]]:
    """Each ``logger.warning(...)`` call of ``module``: its line and its literal text."""
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "warning"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "logger"):
            literal = " ".join(arg.value for arg in node.args
                               if isinstance(arg, ast.Constant) and isinstance(arg.value, str))
            found.append((node.lineno, literal))
    return found


def test_every_startup_warning_names_an_existing_section_of_the_docs() -> None:
    sections = startup_sections()
    assert {"prefetch", "heartbeats-on-rabbitmq", "retry-delay", "persistence", "eviction",
            "replicas", "declared-effects", "task-events-for-flower",
            "dead-letters-waiting"} <= sections
    named = set()
    for module in MODULES:
        for line, literal in warnings_in(module):
            references = REFERENCE.findall(literal)
            assert references, f"{module}:{line}: the warning names no docs section"
            assert set(references) <= sections, f"{module}:{line}: {references}"
            named.update(references)
    # Every section but the one about Flower's task events (no warning) is named.
    assert named == sections - {"task-events-for-flower"}


def test_the_prefetch_section_is_what_the_prefetch_warning_names() -> None:
    [(_, literal)] = [(line, text) for line, text in warnings_in("worker/startup.py")
                      if "worker_prefetch_multiplier" in text]
    assert REFERENCE.findall(literal) == ["prefetch"]
