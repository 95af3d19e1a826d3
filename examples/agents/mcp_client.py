"""An MCP client (the ``mcp`` SDK's ``ClientSession``) of the example tools,
served by ``celery -A examples.agent_app tooleffect mcp`` over stdio::

    python -m examples.agents.mcp_client

It prints what ``tools/list`` answers and calls a read and a write, as an
agent runtime's MCP client would.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters, stdio_client

from examples.agents.common import ROOT, example_worker


async def main() -> None:
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "celery", "-A", "examples.agent_app",
                                      "tooleffect", "mcp"],
        env=dict(os.environ), cwd=str(ROOT))
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = await session.list_tools()
        print("tools/list:")
        print(json.dumps([tool.model_dump(by_alias=True, exclude_none=True)
                          for tool in listed.tools], indent=2))
        for name, arguments in (("agent.search_catalog", {"query": "usb-c"}),
                                ("agent.send_invoice", {"customer_id": "cust-42",
                                                        "amount_cents": 1999})):
            result = await session.call_tool(name, arguments)
            print(f"tools/call {name} {json.dumps(arguments)} -> isError={result.is_error}")
            print(json.dumps(result.structured_content, indent=2))


if __name__ == "__main__":
    with example_worker():
        asyncio.run(main())
