"""Real inputs of the ``prefix`` bench: SWE-bench agent sessions and MCP tool lists.

Sessions are the mini-swe-agent runs in ``trajectories/swebench_minisweagent``; the tool
list mixes two real MCP servers: the smallest tools of github/github-mcp-server
(``github_mcp_tools``) and one server of the docker/mcp-registry (``clickhouse``). The tools
are listed to the model but never called (the recording only calls ``bash``): they are
what a harness with MCP servers connected sends on every request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loopstack.harness.tools.tool import ToolResult
from loopstack.tools import ToolInfo

__all__ = ["ListedTool", "bench_tools", "trajectory_paths"]

GITHUB = Path("github_mcp_tools") / "github_mcp_server_tools.json"
DOCKER_REGISTRY = Path("docker_mcp_registry") / "docker_mcp_registry_tools.jsonl"
TRAJECTORIES = Path("trajectories") / "swebench_minisweagent" / "full_trajectories"


class ListedTool:
    """An MCP tool that is listed to the model; a call answers that the server is offline."""

    is_concurrency_safe = True

    def __init__(self, info: ToolInfo) -> None:
        self.info = info

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(f"MCP server {self.info.namespace!r} is not connected in this replay", is_error=True)


def _github_tools(data_dir: Path, count: int) -> list[ToolInfo]:
    tools = json.loads((data_dir / GITHUB).read_text())
    smallest = sorted(tools, key=lambda t: (len(json.dumps(t)), t["name"]))[:count]
    return [ToolInfo(t["name"], t.get("description", "").strip(), t.get("inputSchema") or {"type": "object"},
                     namespace="github") for t in smallest]


def _registry_tools(data_dir: Path, server: str) -> list[ToolInfo]:
    infos = []
    for line in (data_dir / DOCKER_REGISTRY).read_text().splitlines():
        record = json.loads(line)
        if record.get("server") != server:
            continue
        tool = record["tool"]
        properties = {a["name"]: {"type": a.get("type", "string"), "description": a.get("desc", "")}
                      for a in tool.get("arguments") or []}
        infos.append(ToolInfo(tool["name"], tool.get("description", ""), {"type": "object", "properties": properties},
                              namespace=server))
    return infos


def bench_tools(data_dir: Path, *, num_github: int = 6, registry_server: str = "clickhouse") -> list[ListedTool]:
    """The MCP tools the bench's harness lists: ``num_github`` GitHub tools and one registry server's."""
    infos = _github_tools(data_dir, num_github) + _registry_tools(data_dir, registry_server)
    return [ListedTool(info) for info in infos]


def trajectory_paths(data_dir: Path) -> list[Path]:
    return sorted((data_dir / TRAJECTORIES).glob("*.traj.json"))
