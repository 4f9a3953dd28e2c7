"""A tiny MCP server over stdio, for trying the harness's MCP client (and its tests).

Run it with ``python examples/mcp_notes_server.py``. Tools: ``add_note``, ``list_notes``,
``search_notes`` and ``enable_archive``, which registers ``archive_note`` and sends
``notifications/tools/list_changed``. Notes live in memory for the life of the process.
"""

from __future__ import annotations

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("notes", log_level="WARNING")
notes: dict[str, str] = {}


@server.tool()
def add_note(title: str, body: str) -> str:
    """Store a note under ``title`` (replacing one with the same title)."""
    notes[title] = body
    return f"saved {title!r}"


@server.tool()
def list_notes() -> list[str]:
    """The titles of all notes, in insertion order."""
    return list(notes)


@server.tool()
def search_notes(query: str) -> list[dict[str, str]]:
    """Notes whose title or body contains ``query`` (case-insensitive)."""
    needle = query.lower()
    return [{"title": t, "body": b} for t, b in notes.items() if needle in t.lower() or needle in b.lower()]


def archive_note(title: str) -> str:
    """Remove a note; fails if there is no note with that title."""
    if title not in notes:
        raise ToolError(f"no note titled {title!r}")  # ToolError: the message reaches the client
    del notes[title]
    return f"archived {title!r}"


@server.tool()
async def enable_archive(ctx: Context) -> str:
    """Add the ``archive_note`` tool and tell the client its tool list changed."""
    if "archive_note" not in [tool.name for tool in await server.list_tools()]:
        server.add_tool(archive_note)
    await ctx.session.send_tool_list_changed()
    return "archive_note enabled"


if __name__ == "__main__":
    server.run("stdio")
