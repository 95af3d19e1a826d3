"""The layout the docs draw is the code's: every module in docs/architecture.md,
one error tree, and an ``import celery_tooleffect`` that loads no admin code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import celery_tooleffect
from celery_tooleffect import errors

PACKAGE = Path(celery_tooleffect.__file__).parent
ARCHITECTURE = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")


def section(title_part: str) -> str:
    """The text of the docs' ``##`` section whose title contains ``title_part``."""
    for part in re.split(r"^## ", ARCHITECTURE, flags=re.MULTILINE):
        if title_part in part.split("\n", 1)[0]:
            return part
    raise AssertionError(f"no section {title_part!r} in docs/architecture.md")


def test_every_module_is_in_the_architecture_doc() -> None:
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            text, names = section("public vocabulary"), {f"`{parts[0]}`"}
        else:
            text = section(f"`celery_tooleffect/{parts[0]}/`")
            stem = path.stem
            parent = parts[-2]
            names = {f"`{stem}`", f"`{path.name}`", f"`{parent}/{path.name}`"}
            if stem == "__init__":  # a sub-package: its section, or its row
                names |= {f"`celery_tooleffect/{parent}/`", f"`{parent}/`"}
        if not any(name in text for name in names):
            missing.append("/".join(parts))
    assert missing == [], f"not in docs/architecture.md: {missing}"


def _tree(text: str) -> list[str]:
    return re.findall(r"^\s*(?:\|\s*)*\+-- (\w+)", text, flags=re.MULTILINE)


def test_the_error_tree_of_the_docs_is_the_one_of_errors_py() -> None:
    drawn = _tree(section("The errors"))
    assert drawn and drawn == _tree(errors.__doc__ or "")


def test_importing_the_package_loads_no_admin_code() -> None:
    code = ("import sys, celery_tooleffect; "
            "print(sorted(m for m in sys.modules if m.startswith('celery_tooleffect.admin')))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout.strip()
    assert loaded == "[]"
    assert "Approvals" in celery_tooleffect.__all__
    from celery_tooleffect.admin.approvals import Approvals

    assert celery_tooleffect.Approvals is Approvals
