"""The ``code-mode`` benchmark's tools and tasks, over the Docker MCP registry records.

Tools are real async Python functions with set latencies over
``../shared/data/docker_mcp_registry/docker_mcp_registry_tools.jsonl`` (4,938 real MCP
tool definitions of 240 servers). Each task is written twice, as the same work: the
dependent steps of direct tool calling (``levels``: the calls of step k follow from the
outputs of steps before it) and one Code Mode program.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from loopstack.harness.tools.tool import PythonTool, python_tool

REGISTRY_FILE = Path("docker_mcp_registry") / "docker_mcp_registry_tools.jsonl"
LATENCY_S = {"get_server": 0.10, "list_tools": 0.15, "list_servers": 0.12, "server_info": 0.06}


class Registry:
    """The registry records, indexed by server and category."""

    def __init__(self, path: Path) -> None:
        self.records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        self.by_server: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in self.records:
            self.by_server[record["server"]].append(record)

    def server(self, name: str) -> dict[str, Any]:
        records = self.by_server.get(name)
        if not records:
            raise KeyError(f"no server named {name!r}")
        head = records[0]
        return {
            "server": name, "title": head.get("title"), "category": head.get("category"), "tags": head.get("tags"),
            "server_description": head.get("server_description"), "source_path": head.get("source_path"),
            "tools": [r["tool"] for r in records],
        }

    def fanout_servers(self, count: int) -> list[str]:
        """``count`` servers of typical size (5-20 KB of JSON each), in name order."""
        typical = [s for s in sorted(self.by_server) if 5_000 <= len(json.dumps(self.by_server[s])) <= 20_000]
        return typical[:count]

    def list_tools(self, category: str) -> list[dict[str, Any]]:
        return [{"id": r["id"], "server": r["server"], "tool": r["tool"]} for r in self.records
                if r.get("category") == category]

    def list_servers(self, category: str) -> list[dict[str, Any]]:
        names = sorted({r["server"] for r in self.records if r.get("category") == category})
        return [{k: v for k, v in self.server(n).items() if k != "tools"} for n in names]

    def server_info(self, name: str) -> dict[str, Any]:
        summary = {k: v for k, v in self.server(name).items() if k != "tools"}
        return {**summary, "num_tools": len(self.by_server[name])}

    def tools(self) -> list[PythonTool]:
        """The four tools, each sleeping its set latency before answering."""

        @python_tool(is_concurrency_safe=True)
        async def get_server(name: str) -> dict:
            """One MCP server of the registry: title, category, tags, description and every tool it has."""
            await anyio.sleep(LATENCY_S["get_server"])
            return self.server(name)

        @python_tool(is_concurrency_safe=True)
        async def list_tools(category: str) -> list[dict]:
            """Every tool of every server in a category (id, server, tool with name, description, arguments)."""
            await anyio.sleep(LATENCY_S["list_tools"])
            return self.list_tools(category)

        @python_tool(is_concurrency_safe=True)
        async def list_servers(category: str) -> list[dict]:
            """The servers of a category: name, title, tags and description."""
            await anyio.sleep(LATENCY_S["list_servers"])
            return self.list_servers(category)

        @python_tool(is_concurrency_safe=True)
        async def server_info(name: str) -> dict:
            """A short summary of one server: title, category, tags, source and number of tools."""
            await anyio.sleep(LATENCY_S["server_info"])
            return self.server_info(name)

        return [get_server, list_tools, list_servers, server_info]

    def expected_answer(self, task: Task) -> Any:
        """``task``'s answer, computed here without tools or latency (what every column must match)."""
        outputs: Outputs = {}
        methods: dict[str, Callable[..., Any]] = {"get_server": self.server, "list_tools": self.list_tools,
                   "list_servers": self.list_servers, "server_info": self.server_info}
        for level in task.levels:
            for call in level(outputs):
                outputs[call.call_id] = json.loads(json.dumps(methods[call.name](**call.arguments)))
        return task.answer(outputs)


@dataclass(frozen=True)
class Call:
    call_id: str
    name: str
    arguments: dict[str, Any]


Outputs = dict[str, Any]  # call_id -> parsed output


@dataclass(frozen=True)
class Task:
    """One task: the question, the direct-calling steps, the answer, and the program."""

    name: str
    question: str
    levels: tuple[Callable[[Outputs], list[Call]], ...]
    answer: Callable[[Outputs], Any]
    program: str


def fanout(registry: Registry, count: int) -> Task:
    servers = registry.fanout_servers(count)
    program = f"""
const names = {json.dumps(servers)};
const found = await Promise.all(names.map(name => tools.get_server({{name}})));
return Object.fromEntries(found.map(s => [s.server, s.tools.length]));
""".strip()
    return Task(
        name=f"fanout{count}",
        question=f"How many tools does each of these servers have: {', '.join(servers)}?",
        levels=(lambda _: [Call(f"get_server:{s}", "get_server", {"name": s}) for s in servers],),
        answer=lambda out: {s: len(out[f"get_server:{s}"]["tools"]) for s in servers},
        program=program,
    )


def _most_arguments(tools: list[dict[str, Any]]) -> dict[str, Any]:
    # most arguments first, then the smaller id (the program breaks ties the same way)
    return min(tools, key=lambda t: (-len(t["tool"].get("arguments") or []), t["id"]))


def chain_filter(category: str = "analytics") -> Task:
    list_id = f"list_tools:{category}"

    def second(out: Outputs) -> list[Call]:
        best = _most_arguments(out[list_id])
        return [Call(f"server_info:{best['server']}", "server_info", {"name": best["server"]})]

    def answer(out: Outputs) -> dict[str, Any]:
        best = _most_arguments(out[list_id])
        info = out[f"server_info:{best['server']}"]
        return {"tool": best["id"], "num_arguments": len(best["tool"].get("arguments") or []), "server_title": info["title"]}

    program = f"""
const all = await tools.list_tools({{category: {json.dumps(category)}}});
const count = t => (t.tool.arguments || []).length;
const best = all.reduce((a, b) => (count(b) > count(a) || (count(b) === count(a) && b.id < a.id)) ? b : a);
const info = await tools.server_info({{name: best.server}});
return {{tool: best.id, num_arguments: count(best), server_title: info.title}};
""".strip()
    return Task(
        name="chain_filter",
        question=f"Which {category} tool takes the most arguments, and what is the title of its server?",
        levels=(lambda _: [Call(list_id, "list_tools", {"category": category})], second),
        answer=answer,
        program=program,
    )


def join(category: str = "search", top: int = 5) -> Task:
    servers_id, tools_id = f"list_servers:{category}", f"list_tools:{category}"

    def answer(out: Outputs) -> list[dict[str, Any]]:
        counts: dict[str, int] = defaultdict(int)
        for record in out[tools_id]:
            counts[record["server"]] += 1
        rows = [{"server": s["server"], "title": s["title"], "num_tools": counts[s["server"]]} for s in out[servers_id]]
        return sorted(rows, key=lambda r: (-r["num_tools"], r["server"]))[:top]

    program = f"""
const [servers, all] = await Promise.all([
  tools.list_servers({{category: {json.dumps(category)}}}),
  tools.list_tools({{category: {json.dumps(category)}}}),
]);
const counts = {{}};
for (const t of all) counts[t.server] = (counts[t.server] || 0) + 1;
return servers
  .map(s => ({{server: s.server, title: s.title, num_tools: counts[s.server] || 0}}))
  .sort((a, b) => b.num_tools - a.num_tools || (a.server < b.server ? -1 : a.server > b.server ? 1 : 0))
  .slice(0, {top});
""".strip()
    return Task(
        name="join",
        question=f"Which {top} {category} servers have the most tools, with their titles?",
        levels=(lambda _: [Call(servers_id, "list_servers", {"category": category}),
                           Call(tools_id, "list_tools", {"category": category})],),
        answer=answer,
        program=program,
    )


def all_tasks(registry: Registry) -> list[Task]:
    return [fanout(registry, 5), fanout(registry, 20), chain_filter(), join()]
