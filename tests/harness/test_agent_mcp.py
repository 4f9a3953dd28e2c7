"""An MCP server given to the Agent is re-listed each turn: tools/list_changed reaches the model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from loopstack.harness.agent import Agent
from loopstack.harness.events import ToolCalled
from loopstack.harness.tools.mcp import MCPServer

NOTES_SERVER = Path(__file__).parents[2] / "examples" / "mcp_notes_server.py"


class _Script:
    """A scripted model (test double): enable the archive tool, archive a note, answer."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.steps = [("add_note", {"title": "a", "body": "x"}), ("enable_archive", {}), ("archive_note", {"title": "a"})]

    async def create(self, request: dict[str, Any], ctx: Any) -> dict[str, Any]:
        self.requests.append(request)
        if self.steps:
            name, arguments = self.steps.pop(0)
            output = [{"type": "function_call", "call_id": name, "name": name, "arguments": json.dumps(arguments)}]
        else:
            output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
        return {"output": output, "usage": {}}


def test_a_tool_added_by_list_changed_is_offered_and_callable_on_the_next_turn():
    model = _Script()

    async def main():
        with anyio.fail_after(60):
            async with MCPServer.stdio(sys.executable, [str(NOTES_SERVER)], name="notes") as notes:
                agent = Agent(model, [notes], instructions="", max_turns=6)
                return await agent.run("archive note a")

    result = anyio.run(main)
    offered = [[t["name"] for t in r["tools"]] for r in model.requests]
    assert "archive_note" not in offered[0] and "archive_note" not in offered[1]
    assert "archive_note" in offered[2]  # listed again after the server's notification
    calls = [(e.name, e.is_error, e.result_text) for e in result.events if isinstance(e, ToolCalled)]
    assert calls[-1] == ("archive_note", False, "archived 'a'")
    assert result.final_text == "done"
