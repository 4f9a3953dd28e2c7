"""MCP servers as tool sources, through the official ``mcp`` SDK (``pip install loopstack[mcp]``).

``MCPServer`` holds one client session (stdio subprocess or streamable HTTP); its
``list_tools`` returns :class:`~loopstack.harness.tools.tool.Tool` objects namespaced by the
server name. A ``notifications/tools/list_changed`` from the server bumps ``version`` and
marks the cached list stale, so the next ``list_tools`` asks the server again.

Example::

    async with MCPServer.stdio(sys.executable, ["examples/mcp_notes_server.py"], name="notes") as server:
        tools = {tool.info.name: tool for tool in await server.list_tools()}
        result = await tools["add_note"].call({"title": "a", "body": "b"})
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self, TextIO

import anyio
import mcp
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from loopstack.harness.tools.tool import ToolResult, serialize_result
from loopstack.tools import ToolInfo

__all__ = ["MCPServer", "MCPServerStatistics", "MCPTool"]

_TOOLS_LIST_CHANGED = "notifications/tools/list_changed"

TransportFactory = Callable[[], AbstractAsyncContextManager[Any]]


class MCPServerStatistics(NamedTuple):
    version: int
    num_tools: int
    num_list_requests: int
    num_calls: int
    num_call_errors: int


def _result_text(result: mcp.types.CallToolResult) -> str:
    parts: list[str] = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else serialize_result(block.model_dump(mode="json")))
    if not parts and result.structured_content is not None:
        parts.append(serialize_result(result.structured_content))
    return "\n".join(parts)


class MCPTool:
    """One tool of an :class:`MCPServer`; ``call`` goes through the server's session.

    Read-only tools (``annotations.readOnlyHint``) are concurrency-safe.
    """

    def __init__(self, server: MCPServer, info: ToolInfo, *, is_concurrency_safe: bool) -> None:
        self.server = server
        self.info = info
        self.is_concurrency_safe = is_concurrency_safe

    def __repr__(self) -> str:
        return f"MCPTool({self.info.namespace!r}, {self.info.name!r})"

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        return await self.server.call_tool(self.info.name, arguments)


class MCPServer:
    """A connection to one MCP server; use :meth:`stdio` or :meth:`http`, then ``async with``.

    Args:
        connect: opens the transport; an async context manager yielding ``(read, write)`` streams.
        name: the server name, used as the tools' namespace.
        defer_loading: mark every tool of this server as found through search, not listed.
        read_timeout_s: seconds to wait for any response (``None`` waits forever).
    """

    def __init__(
        self,
        connect: TransportFactory,
        *,
        name: str,
        defer_loading: bool = False,
        read_timeout_s: float | None = 30.0,
    ) -> None:
        self.name = name
        self.defer_loading = defer_loading
        self.read_timeout_s = read_timeout_s
        self.version = 0
        self._connect = connect
        self._stack: AsyncExitStack | None = None
        self._session: mcp.ClientSession | None = None
        self._tools: list[MCPTool] | None = None
        self._listed_version = -1
        self._changed = anyio.Event()
        self._num_list_requests = 0
        self._num_calls = 0
        self._num_call_errors = 0

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        name: str,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        errlog: TextIO | None = None,
        defer_loading: bool = False,
        read_timeout_s: float | None = 30.0,
    ) -> MCPServer:
        """A server started as a subprocess and spoken to over stdin/stdout.

        ``env`` is merged over the SDK's safe default environment; the server's stderr
        goes to ``errlog`` (default ``sys.stderr``).
        """
        params = StdioServerParameters(command=command, args=list(args), env=env, cwd=cwd)
        return cls(
            lambda: stdio_client(params, errlog=errlog or sys.stderr),
            name=name,
            defer_loading=defer_loading,
            read_timeout_s=read_timeout_s,
        )

    @classmethod
    def http(
        cls,
        url: str,
        *,
        name: str,
        http_client: Any = None,
        defer_loading: bool = False,
        read_timeout_s: float | None = 30.0,
    ) -> MCPServer:
        """A server reached over streamable HTTP at ``url``.

        ``http_client`` is an optional pre-configured ``httpx2.AsyncClient`` (headers, auth).
        """
        return cls(
            lambda: streamable_http_client(url, http_client=http_client),
            name=name,
            defer_loading=defer_loading,
            read_timeout_s=read_timeout_s,
        )

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError(f"MCP server {self.name!r} is already connected")
        async with AsyncExitStack() as stack:
            read_stream, write_stream = await stack.enter_async_context(self._connect())
            session = mcp.ClientSession(
                read_stream,
                write_stream,
                read_timeout_seconds=self.read_timeout_s,
                message_handler=self._on_message,
            )
            await stack.enter_async_context(session)
            await session.initialize()
            self._stack = stack.pop_all()
        self._session = session
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack, self._session, self._tools = self._stack, None, None, None
        if stack is not None:
            await stack.__aexit__(exc_type, exc, tb)

    def _require_session(self) -> mcp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"MCP server {self.name!r} is not connected; use 'async with'")
        return self._session

    async def _on_message(self, message: Any) -> None:
        if getattr(message, "method", None) == _TOOLS_LIST_CHANGED:
            self.version += 1
            self._changed.set()
            self._changed = anyio.Event()
        await anyio.lowlevel.checkpoint()

    async def wait_for_change(self, version: int) -> int:
        """Wait until ``self.version`` is past ``version``; returns the new version."""
        while self.version <= version:
            await self._changed.wait()
        return self.version

    async def list_tools(self) -> list[MCPTool]:
        """The server's tools; cached until the server says its list changed.

        Raises:
            RuntimeError: not connected.
            mcp.MCPError: the server answered the request with an error.
        """
        session = self._require_session()
        if self._tools is not None and self._listed_version == self.version:
            return list(self._tools)
        version = self.version
        listed: list[mcp.types.Tool] = []
        cursor: str | None = None
        while True:
            self._num_list_requests += 1
            params = mcp.types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        self._tools = [self._wrap(tool) for tool in listed]
        # A change that arrived while listing leaves the cache stale on purpose.
        self._listed_version = version
        return list(self._tools)

    def _wrap(self, tool: mcp.types.Tool) -> MCPTool:
        info = ToolInfo(
            name=tool.name,
            description=tool.description or "",
            parameters=dict(tool.input_schema),
            namespace=self.name,
            defer_loading=self.defer_loading,
        )
        is_read_only = bool(tool.annotations and tool.annotations.read_only_hint)
        return MCPTool(self, info, is_concurrency_safe=is_read_only)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Call tool ``name``; server-side failures (``isError``, protocol errors) become error results."""
        session = self._require_session()
        self._num_calls += 1
        try:
            result = await session.call_tool(name, arguments)
        except mcp.MCPError as error:
            self._num_call_errors += 1
            return ToolResult(f"MCPError: {error.error.message}", is_error=True)
        if result.is_error:
            self._num_call_errors += 1
        return ToolResult(_result_text(result), is_error=result.is_error)

    def statistics(self) -> MCPServerStatistics:
        return MCPServerStatistics(
            version=self.version,
            num_tools=len(self._tools or ()),
            num_list_requests=self._num_list_requests,
            num_calls=self._num_calls,
            num_call_errors=self._num_call_errors,
        )
