"""What an import of an agent integration says when its extra is not installed.

The core package depends on Celery, kombu, redis-py and click only; each agent
integration needs an extra (``pyproject.toml``): ``mcp`` for the MCP server,
``openai-agents``, ``langchain`` and ``pydantic-ai`` for the adapters. A module
that imports one of them turns the bare ``ModuleNotFoundError`` into one that
says which extra to install (:func:`missing_extra`).
"""

from __future__ import annotations

#: What the shared agent modules (:mod:`.calls`, :mod:`.schema`) need: any of the extras.
ANY_AGENT_EXTRA = "mcp"


def missing_extra(exc: ModuleNotFoundError, module: str, extra: str) -> ModuleNotFoundError:
    """A ``ModuleNotFoundError`` for ``exc``'s module that names the ``extra``
    bringing it: ``... pip install 'celery-tooleffect[openai-agents]'``. Raise
    it ``from exc``."""
    missing = exc.name or str(exc)
    hint = f"pip install 'celery-tooleffect[{extra}]'"
    if extra == ANY_AGENT_EXTRA:
        hint += (" (or the extra of your agent SDK: [openai-agents], [langchain] or "
                 "[pydantic-ai])")
    return ModuleNotFoundError(
        f"{module} needs {missing!r}, which is not installed: {hint}", name=exc.name)
