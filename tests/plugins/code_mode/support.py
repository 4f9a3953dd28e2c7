"""Helpers for the Code Mode tests: a scripted model, stacks, and a run helper."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from loopstack import PluginCatalog, StackLoader, StackRuntime


def run(main: Callable[[], Awaitable[Any]], timeout_s: float = 20) -> Any:
    """Run ``main`` under asyncio with a hard deadline (a hang fails the test)."""

    async def bounded() -> Any:
        with anyio.fail_after(timeout_s):
            return await main()

    return anyio.run(bounded)


def call_item(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)}


def exec_item(code: str, call_id: str = "c-exec") -> dict[str, Any]:
    return call_item("exec", {"code": textwrap.dedent(code).strip()}, call_id)


def text_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


class ScriptedModel:
    """A test double for a model: answers each request with the next scripted output."""

    def __init__(self, outputs: list[list[dict[str, Any]]]) -> None:
        self.outputs = list(outputs)
        self.requests: list[dict[str, Any]] = []

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        self.requests.append(json.loads(json.dumps(request)))
        output = self.outputs.pop(0) if self.outputs else [text_item("done")]
        return {"output": output, "usage": {"input_tokens": 1, "output_tokens": 1}}

    def tool_names(self, index: int = 0) -> list[str]:
        return [t["name"] for t in self.requests[index].get("tools", [])]

    def outputs_of(self, index: int) -> list[str]:
        """The ``function_call_output`` texts in request ``index``'s input."""
        return [i["output"] for i in self.requests[index]["input"] if i.get("type") == "function_call_output"]


def runtime_for(tmp_path: Path, table: str, catalog: PluginCatalog | None = None) -> StackRuntime:
    """A runtime over a stack file whose body is ``table`` (TOML)."""
    catalog = catalog or PluginCatalog.discover(use_entry_points=False, env={})
    path = tmp_path / "stack.toml"
    path.write_text(textwrap.dedent(table).lstrip())
    return StackRuntime(StackLoader(catalog).load(path), catalog)


CODE_MODE_ON = """
[plugins.code_mode]
enabled = true
"""
