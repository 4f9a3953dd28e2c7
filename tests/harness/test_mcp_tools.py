"""MCPServer over stdio against examples/mcp_notes_server.py (a real subprocess per test)."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from loopstack.harness.tools.mcp import MCPServer, MCPTool
from loopstack.harness.tools.tool import Tool

NOTES_SERVER = Path(__file__).parents[2] / "examples" / "mcp_notes_server.py"


def with_notes_server(body: Callable[[MCPServer], Awaitable[Any]], **options: Any) -> Any:
    async def main() -> Any:
        with anyio.fail_after(20):
            async with MCPServer.stdio(sys.executable, [str(NOTES_SERVER)], name="notes", **options) as server:
                return await body(server)

    return anyio.run(main)


async def tools_by_name(server: MCPServer) -> dict[str, MCPTool]:
    return {tool.info.name: tool for tool in await server.list_tools()}


def test_list_tools_namespaced_with_schema() -> None:
    tools = with_notes_server(tools_by_name, defer_loading=True)
    assert set(tools) == {"add_note", "list_notes", "search_notes", "enable_archive"}
    add_note = tools["add_note"]
    assert isinstance(add_note, Tool)
    assert add_note.info.namespace == "notes"
    assert add_note.info.defer_loading
    assert add_note.info.parameters["required"] == ["title", "body"]
    assert add_note.info.description.startswith("Store a note")


def test_add_then_search() -> None:
    async def body(server: MCPServer) -> None:
        tools = await tools_by_name(server)
        added = await tools["add_note"].call({"title": "groceries", "body": "milk and eggs"})
        await tools["add_note"].call({"title": "work", "body": "ship the harness"})
        found = await tools["search_notes"].call({"query": "MILK"})
        assert not added.is_error and "groceries" in added.text
        assert not found.is_error
        assert json.loads(found.text) == {"title": "groceries", "body": "milk and eggs"}
        assert server.statistics().num_calls == 3

    with_notes_server(body)


def test_bad_calls_are_error_results() -> None:
    async def body(server: MCPServer) -> None:
        tools = await tools_by_name(server)
        missing_field = await tools["add_note"].call({"title": "no body"})
        unknown_tool = await server.call_tool("delete_everything", {})
        assert missing_field.is_error and "body" in missing_field.text
        assert unknown_tool.is_error and "delete_everything" in unknown_tool.text
        assert server.statistics().num_call_errors == 2

    with_notes_server(body)


def test_list_changed_relists_and_bumps_version() -> None:
    async def body(server: MCPServer) -> None:
        before = await tools_by_name(server)
        assert "archive_note" not in before
        assert await server.list_tools() == list(before.values())  # cached: no new request
        assert server.statistics().num_list_requests == 1
        version = server.version
        assert not (await before["enable_archive"].call({})).is_error
        assert await server.wait_for_change(version) == version + 1
        after = await tools_by_name(server)
        assert "archive_note" in after
        assert server.statistics().num_list_requests == 2
        await after["add_note"].call({"title": "old", "body": "x"})
        archived = await after["archive_note"].call({"title": "old"})
        not_found = await after["archive_note"].call({"title": "old"})
        assert not archived.is_error
        assert not_found.is_error and "no note titled 'old'" in not_found.text

    with_notes_server(body)


def test_streamable_http_loopback() -> None:
    uvicorn = pytest.importorskip("uvicorn")
    from mcp.server.mcpserver import MCPServer as SDKServer

    sdk_server = SDKServer("echo", log_level="WARNING")

    @sdk_server.tool()
    def shout(text: str) -> str:
        """Upper-case the text."""
        return text.upper()

    async def main() -> None:
        config = uvicorn.Config(sdk_server.streamable_http_app(), log_level="warning", lifespan="on")
        web = uvicorn.Server(config)
        # Bound and listening before serve() starts: the client's connect waits in the backlog.
        with socket.socket() as sock, anyio.fail_after(10):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = sock.getsockname()[1]
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(lambda: web.serve(sockets=[sock]))
                async with MCPServer.http(f"http://127.0.0.1:{port}/mcp", name="echo") as server:
                    (tool,) = await server.list_tools()
                    result = await tool.call({"text": "hi"})
                web.should_exit = True
        assert (tool.info.namespace, tool.info.name, result.text) == ("echo", "shout", "HI")

    anyio.run(main)


def test_not_connected_raises() -> None:
    server = MCPServer.stdio(sys.executable, [str(NOTES_SERVER)], name="notes")
    with pytest.raises(RuntimeError, match="not connected"):
        anyio.run(server.list_tools)
