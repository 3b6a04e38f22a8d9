"""`ecc mcp`: the agents' door, an MCP server on stdio built with the official SDK.

The SDK's low-level `Server`, not `MCPServer`'s decorators: those infer a tool's schema from a
Python signature, and these schemas are given, generated from the API's own types (`ecc.tools`).
`tools/list` lists `ecc.tools.TOOLS`, then the two local ones of `ecc.manifest_tools` (validate,
manifest_schema), each with the envelope as its output schema: the whole list stays under
`tools.CATALOGUE_MAX_BYTES`; `tools/call` runs `ecc.tools.call` (or the local tool's) with this server's
connect and overall timeouts, its progress going to the caller's progress token when the request
carries one (`wait`'s), and answers the envelope as structured content and as the same JSON in text
(`isError` when it is not ok). stdout carries only JSON-RPC: nothing here prints.

Imported only by `ecc mcp` (the SDK takes ~0.7 s to import); `ecc ito` never loads it.
"""

import asyncio
from importlib import metadata
from typing import Any

import mcp.types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from ecc import manifest_tools, tools
from ecc.verbs import Bounds


def _version() -> str:
    try:
        return metadata.version("ito-training")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0"


def listed() -> list[types.Tool]:
    """Every tool as MCP lists it: name, description, input and output schema, hints."""
    return [
        types.Tool(
            name=t.name,
            description=t.description,
            input_schema=tools.input_schema(t),
            output_schema=tools.LISTED_OUTPUT_SCHEMA,
            annotations=types.ToolAnnotations.model_validate(t.hints),
        )
        for t in tools.TOOLS.values()
    ] + [
        types.Tool(
            name=t.name,
            description=t.description,
            input_schema=t.input_schema,
            output_schema=tools.LISTED_OUTPUT_SCHEMA,
            annotations=types.ToolAnnotations.model_validate(t.hints),
        )
        for t in manifest_tools.TOOLS.values()
    ]


def build(bounds: Bounds) -> Server[Any]:
    """The server: its tools, their calls bounded by `bounds`, its instructions to the agent."""
    catalogue = types.ListToolsResult(tools=listed())  # the same for every caller: built once

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return catalogue

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        async def progress(done: float, total: float | None, message: str) -> None:
            await ctx.session.report_progress(done, total, message)  # a no-op without a progress token

        arguments = dict(params.arguments or {})
        if params.name in manifest_tools.TOOLS:  # local: no server, no login
            env = manifest_tools.call(params.name, arguments)
        else:
            env = await tools.call(params.name, arguments, bounds, progress)
        structured, text = tools.result(env)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=structured,
            is_error=not env.ok,
        )

    return Server(
        "ecc",
        version=_version(),
        title="ito-training (ecc)",
        instructions=tools.INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def _serve(bounds: Bounds) -> None:
    server = build(bounds)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def serve(connect_timeout_s: float, timeout_s: float) -> int:
    """Serve on stdin/stdout until the client closes them; 0 then."""
    asyncio.run(_serve(Bounds(connect_timeout_s, timeout_s)))
    return 0
