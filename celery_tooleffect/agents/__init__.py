"""Agents reach the tools: what an agent is told about a tool and how its call
runs, shared by the MCP server and the agent SDK adapters.

- :class:`ToolSpec` (:mod:`.schema`): a tool's schema, description and
  annotations, from its code;
- :class:`ToolCaller` and :class:`CallReport` (:mod:`.calls`): validate,
  publish with the agent's call id and run id, wait, report;
- :mod:`.mcp_server`: ``celery -A app tooleffect mcp`` (extra ``mcp``);
- :mod:`.openai_agents`, :mod:`.langchain`, :mod:`.pydantic_ai`: each SDK's
  tool objects (extras ``openai-agents``, ``langchain``, ``pydantic-ai``).

Importing this package loads no agent SDK; each adapter module imports its own.
"""

from .calls import STATUS_TOOL, CallReport, ToolCaller
from .schema import MAX_ARGUMENT_BYTES, ToolSpec

__all__ = ["MAX_ARGUMENT_BYTES", "STATUS_TOOL", "CallReport", "ToolCaller", "ToolSpec"]
