"""Consumer step that dead-letters messages Celery would reject before any task code runs."""

from __future__ import annotations

from typing import Any


def install_consumer_step(app: Any) -> None:
    """Add the dead-lettering consumer step to ``app`` (idempotent). Stub: to be built."""
    return None
