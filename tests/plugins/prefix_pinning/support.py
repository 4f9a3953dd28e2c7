"""Helpers for the prefix_pinning tests: tools of several MCP servers, a scripted model,
and runtimes with the ``unstable_harness`` fault injector in the catalog."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from loopstack import PluginCatalog, StackLoader, StackRuntime
from loopstack.harness.clients.base import serialize_request
from loopstack.harness.tools.tool import ToolResult
from loopstack.testing.faults import UnstableHarness
from loopstack.tools import ToolInfo


def _schema(*names: str) -> dict[str, Any]:
    # properties deliberately not in sorted order: pinning sorts schema keys
    return {"type": "object", "properties": {n: {"type": "string", "description": f"the {n}"} for n in names},
            "required": list(names[:1])}


SERVER_TOOLS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "github": [("search_issues", ("query", "owner", "repo")), ("get_file_contents", ("path", "owner", "repo")),
               ("create_pull_request", ("title", "head", "base", "body"))],
    "filesystem": [("read_file", ("path",)), ("write_file", ("path", "content")), ("list_directory", ("path",))],
    "slack": [("post_message", ("channel", "text")), ("list_channels", ("limit", "cursor"))],
}


class StaticTool:
    """A tool that answers every call with a fixed text."""

    is_concurrency_safe = True

    def __init__(self, info: ToolInfo, output: str = "ok") -> None:
        self.info = info
        self.output = output

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(f"{self.output} {self.info.name} {json.dumps(arguments, sort_keys=True)}")


def mcp_tools() -> list[StaticTool]:
    """Eight tools from three MCP servers, namespaced by server."""
    return [StaticTool(ToolInfo(name, f"{server}: {name.replace('_', ' ')}", _schema(*props), namespace=server))
            for server, tools in SERVER_TOOLS.items() for name, props in tools]


def call_item(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)}


def message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


class ScriptedModel:
    """Answers turn n with ``outputs[n]``; records each request and the bytes it serialized to."""

    def __init__(self, outputs: list[list[dict[str, Any]]]) -> None:
        self.outputs = list(outputs)
        self.requests: list[dict[str, Any]] = []
        self.bodies: list[bytes] = []

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        self.bodies.append(serialize_request(request, ctx))
        self.requests.append(json.loads(json.dumps(request)))
        output = self.outputs.pop(0) if self.outputs else [message_item("done")]
        return {"output": output, "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                                             "output_tokens": 1}}


def tool_turns(n: int) -> list[list[dict[str, Any]]]:
    """n turns that each call a different tool, then a final answer."""
    names = [name for tools in SERVER_TOOLS.values() for name, _ in tools]
    return [[message_item(f"step {i}"), call_item(names[i % len(names)], {"path": f"f{i}"}, f"c{i}")]
            for i in range(n)] + [[message_item("all done")]]


def catalog_with_faults() -> PluginCatalog:
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(UnstableHarness, source="tests")
    return catalog


def stack_file(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[stack]\nname = "{name}"\nextends = "baseline"\n\n' + textwrap.dedent(body).lstrip())
    return path


def runtime_for(tmp_path: Path, body: str, name: str = "s") -> StackRuntime:
    catalog = catalog_with_faults()
    return StackRuntime(StackLoader(catalog).load(stack_file(tmp_path, name, body)), catalog)


PINNED = """
[plugins.prefix_pinning]
enabled = true

[plugins.unstable_harness]
enabled = true
"""

UNPINNED = """
[plugins.unstable_harness]
enabled = true
"""
