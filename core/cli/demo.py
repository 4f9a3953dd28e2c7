"""``loopstack demo`` / ``make demo``: the main job, end to end on the embedded model.

First the plugin kernel (installed plugins, the shipped stacks, the kernel's cost per
request side by side); then the main job (:mod:`loopstack.cli.demo_agent`): the API server on
the default stack with the embedded SmolLM2 engine, and an agent session through it with
a Python tool and an MCP server, reporting what each layer did.
"""

from __future__ import annotations

import asyncio

from loopstack.bench.registry import workloads
from loopstack.bench.report import format_table
from loopstack.bench.runner import run_bench
from loopstack.bench.workload import BenchOptions
from loopstack.catalog import PluginCatalog
from loopstack.cli.demo_agent import run_agent_demo
from loopstack.stack.loader import StackLoader


def _say(text: str = "") -> None:
    print(text, flush=True)


def _kernel(catalog: PluginCatalog) -> list:
    loader = StackLoader(catalog)
    _say("== plugins ==")
    for spec in sorted(catalog, key=lambda s: s.name):
        status = "ready" if spec.implemented else "not implemented yet"
        layers = ",".join(layer.value for layer in spec.layers)
        _say(f"  {spec.name:<16} {layers:<12} {spec.source:<16} {status}")
    _say("\n== stacks ==")
    stacks = [loader.load("baseline"), loader.load("full")]
    for stack in stacks:
        enabled = ", ".join(stack.enabled_plugins()) or "(none)"
        _say(f"  {stack.name}: enabled {enabled}; {len(stack.warnings)} warning(s)")
    _say("\n== kernel overhead per request, side by side ==")
    result = asyncio.run(run_bench(workloads(catalog)["kernel"], stacks, BenchOptions(steps=4), progress=False))
    _say(format_table(result))
    return stacks


def run_demo() -> int:
    catalog = PluginCatalog.discover()
    _kernel(catalog)
    _say("\n== the main job: an agent session through harness, API server and engine ==")
    try:
        return run_agent_demo(_say)
    except Exception as exc:  # say what broke; the exit status tells make
        _say(f"  agent demo failed: {type(exc).__name__}: {exc}")
        return 1
