"""A/B: an experiment splits sessions between tool_search on and off; `loopstack ab report`
shows the schema tokens each request carries fall in the "on" arm."""

from __future__ import annotations

import json
from typing import Any

import anyio

from loopstack import Layer, Plugin, PluginCatalog, StackLoader, StackRuntime, hookimpl
from loopstack.cli.ab_report import compare_arms
from loopstack.cli.main import main
from loopstack.context import Session
from loopstack.harness.agent import Agent
from loopstack.harness.tools.tool import python_tool
from loopstack.plugins.tool_search.schema_tokens import schema_tokens
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from tests.plugins.tool_search.support import ScriptedModel, answer, call, github_tools, needs_model

STACK = """
[plugins.tool_search]
enabled = true
count_schema_tokens = false

[plugins.schema_meter]
enabled = true

[experiments.tools]
plugin = "tool_search"
arms = { on = 0.5, off = 0.5 }
unit = "session"
"""


class SchemaMeter(Plugin):
    """Measures every request from outside, in both arms: the tool-schema tokens it carries."""

    name = "schema_meter"
    layers = (Layer.HARNESS,)

    @hookimpl
    def loopstack_prepare_request(self, request: dict[str, Any], ctx: Any) -> None:
        ctx.observe("tool_schema_tokens", schema_tokens(request.get("tools") or ()), help="schema tokens up front")


def _server_tools() -> list[Any]:
    def make(i: int) -> Any:
        def tool(owner: str, repo: str, ref: str = "main") -> str:
            return f"ok {i}"

        return python_tool(tool, name=f"repo_action_{i}", namespace="github",
                           description=f"Repository action number {i}: inspects branches, commits and workflow runs")

    return [*github_tools(), *(make(i) for i in range(30))]


class ArmAwareModel(ScriptedModel):
    """Searches first when it sees tool_search (arm on), calls create_issue directly otherwise."""

    def __init__(self) -> None:
        super().__init__([])

    async def create(self, request: dict[str, Any], ctx: Any, **_: Any) -> dict[str, Any]:
        self.requests.append(json.loads(json.dumps(request)))
        names = [t["name"] for t in request.get("tools", [])]
        step = sum(1 for item in request["input"] if item.get("type") in ("function_call_output", "tool_search_output"))
        arguments = {"owner": "acme", "repo": "app", "title": "crash"}
        if SEARCH_TOOL_NAME in names:
            script = [[call(SEARCH_TOOL_NAME, {"query": "open an issue", "limit": 1}, "s")],
                      [call("create_issue", arguments, "c")], [answer("filed")]]
        else:
            script = [[call("create_issue", arguments, "c")], [answer("filed")]]
        return {"output": script[min(step, len(script) - 1)], "usage": {"input_tokens": 1, "output_tokens": 1}}


@needs_model
def test_ab_report_shows_fewer_schema_tokens_in_the_on_arm(tmp_path, capsys):
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(SchemaMeter, source="tests")
    path = tmp_path / "ab.toml"
    path.write_text(STACK)
    runtime = StackRuntime(StackLoader(catalog).load(path), catalog)
    arms = []
    for i in range(24):
        session = Session(id=f"session-{i}")
        arms.append(runtime.context(session=session).arm("tool_search"))
        agent = Agent(ArmAwareModel(), _server_tools(), instructions="Use tools.", runtime=runtime, session=session)
        result = anyio.run(agent.run, "file a bug about the crash")
        assert result.final_text == "filed"
    assert {"on", "off"} <= set(arms)

    snapshot = runtime.metrics.snapshot()
    [tokens] = [c for c in compare_arms(snapshot) if c.metric == "tool_schema_tokens"]
    assert tokens.plugin == "tool_search" and tokens.reference == "off"
    ratio, _, high = tokens.ratios["on"]
    assert ratio < 0.2 and high < 1.0  # a clear effect: the interval excludes 1

    snapshot_path = tmp_path / "metrics.json"
    snapshot_path.write_text(json.dumps(snapshot))
    assert main(["ab", "report", str(snapshot_path)]) == 0
    out = capsys.readouterr().out
    assert "tool_search / tool_schema_tokens" in out and "reference arm: off" in out
