"""``loopstack demo`` / ``make demo``: run the most complete thing that exists.

The API server, harness and techniques are later work; until they land the demo runs
the kernel end to end (stacks, plugins, a side-by-side benchmark) and says plainly
what is still missing.
"""

from __future__ import annotations

import asyncio

from .bench.registry import workloads
from .bench.report import format_table
from .bench.runner import run_bench
from .bench.workload import BenchOptions
from .plugin_manager import PluginCatalog
from .stack import StackLoader

MISSING = (
    "API server (Responses API over HTTP/SSE and WebSocket)",
    "harness (agent loop, tools, MCP, sandboxed shell)",
    "the eight techniques (declared and configurable; skipped at run time)",
)


def run_demo() -> int:
    catalog = PluginCatalog.discover()
    loader = StackLoader(catalog)
    print("== plugins ==")
    for spec in sorted(catalog, key=lambda s: s.name):
        status = "ready" if spec.implemented else "not implemented yet"
        print(f"  {spec.name:<16} {','.join(l.value for l in spec.layers):<12} {spec.source:<16} {status}")
    print("\n== stacks ==")
    stacks = [loader.load("baseline"), loader.load("full")]
    for stack in stacks:
        print(f"  {stack.name}: enabled {', '.join(stack.enabled_plugins()) or '(none)'}; {len(stack.warnings)} warning(s)")
    print("\n== kernel overhead, side by side ==")
    result = asyncio.run(run_bench(workloads(catalog)["kernel"], stacks, BenchOptions(steps=4), progress=False))
    print(format_table(result))
    print("\n== not built yet ==")
    for item in MISSING:
        print(f"  - {item}")
    return 0
