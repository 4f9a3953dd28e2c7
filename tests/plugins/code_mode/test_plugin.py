"""Code Mode through the agent loop: the exec tool, its description, visibility, approval, metrics."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Annotated, ClassVar, Literal

import pytest
from pydantic import Field

from loopstack import Layer, Plugin, hookimpl
from loopstack.harness.agent import Agent
from loopstack.harness.events import ToolCalled
from loopstack.harness.tools.shell import ShellTool
from loopstack.harness.tools.tool import ToolResult, python_tool
from loopstack.plugins.code_mode.exec_tool import SESSION_CONTEXTS
from loopstack.stack.schema import HarnessConfig
from tests.plugins.code_mode.support import (
    CODE_MODE_ON,
    ScriptedModel,
    call_item,
    exec_item,
    run,
    runtime_for,
    text_item,
)


@python_tool(is_concurrency_safe=True)
def get_weather(city: Annotated[str, Field(description="city name")], unit: Literal["C", "F"] = "C") -> dict:
    """Current weather in a city."""
    return {"city": city, "temperature": 18, "unit": unit, "history": list(range(200))}


@python_tool
def add_note(title: str, body: str = "") -> str:
    """Save a note."""
    return f"saved {title}"


def agent_run(tmp_path, outputs, tools=(get_weather, add_note), table=CODE_MODE_ON, **kwargs):
    model = ScriptedModel(outputs)
    runtime = kwargs.pop("runtime", None) or runtime_for(tmp_path, table)

    async def main():
        agent = Agent(model, list(tools), instructions="Use tools.", runtime=runtime, **kwargs)
        return await agent.run("task")

    return model, run(main), runtime


def exec_results(result) -> list[ToolCalled]:
    return [e for e in result.events if isinstance(e, ToolCalled) and e.name == "exec"]


def test_exec_is_listed_with_typescript_declarations_of_the_tools(tmp_path):
    model, _, _ = agent_run(tmp_path, [[text_item("hi")]])
    assert model.tool_names() == ["get_weather", "add_note", "exec"]
    description = model.requests[0]["tools"][2]["description"]
    assert "declare const tools: {" in description
    assert "/** Current weather in a city. */" in description
    assert "get_weather(args: {" in description and "city: string;" in description
    assert 'unit?: "C" | "F";' in description
    assert "add_note(args: {" in description and "body?: string;" in description
    assert "exec(" not in description


def test_a_program_fans_out_and_only_its_result_enters_the_context(tmp_path):
    program = """
        const cities = ["Paris", "Oslo", "Lima"];
        const all = await Promise.all(cities.map(city => tools.get_weather({city})));
        console.log("fetched", all.length);
        return all.map(w => [w.city, w.temperature]);
    """
    model, result, runtime = agent_run(tmp_path, [[exec_item(program)], [text_item("done")]])
    [called] = exec_results(result)
    assert not called.is_error
    assert called.result_text == '[["Paris",18],["Oslo",18],["Lima",18]]\n--- console ---\nfetched 3'
    assert model.outputs_of(1) == [called.result_text]  # the 200-item histories never entered the context
    assert result.turns == 2
    metrics = {m["name"]: m for m in runtime.metrics.snapshot()["metrics"]}
    [programs] = metrics["code_mode_programs_total"]["series"]
    assert programs["labels"]["outcome"] == "ok" and programs["value"] == 1
    [per_program] = metrics["code_mode_tool_calls_per_program"]["series"]
    assert per_program["samples"] == [3]
    [kept] = metrics["code_mode_intermediate_bytes_total"]["series"]
    assert kept["value"] > 3 * 600  # three weather records of 200 numbers each
    assert metrics["code_mode_exec_seconds"]["series"][0]["samples"][0] > 0


def test_code_mode_only_lists_exec_but_programs_reach_every_tool(tmp_path):
    table = CODE_MODE_ON + "code_mode_only = true\n"
    program = "return (await tools.get_weather({city: 'Rome'})).city + ' / ' + typeof tools.exec"
    model, result, _ = agent_run(tmp_path, [[exec_item(program)], [text_item("ok")]], table=table)
    assert model.tool_names() == ["exec"]
    assert "get_weather(args: {" in model.requests[0]["tools"][0]["description"]
    assert exec_results(result)[0].result_text == '"Rome / undefined"'


def test_code_mode_only_keeps_tool_search_listed_and_callable_from_programs(tmp_path):
    @python_tool(name="tool_search", is_concurrency_safe=True)
    def tool_search(query: str) -> list[str]:
        """Find tools by what they do."""
        return [name for name in ("get_weather", "add_note") if query in name]

    table = CODE_MODE_ON + "code_mode_only = true\n"
    program = "const [name] = await tools.tool_search({query: 'weather'}); return (await tools[name]({city: 'Bern'})).city"
    model, result, _ = agent_run(tmp_path, [[exec_item(program)], [text_item("ok")]],
                                 tools=(get_weather, add_note, tool_search), table=table)
    assert model.tool_names() == ["tool_search", "exec"]
    assert "tools.tool_search(" in model.requests[0]["tools"][1]["description"]
    assert exec_results(result)[0].result_text == '"Bern"'


def test_tool_errors_and_validation_reject_inside_the_program(tmp_path):
    program = """
        try { await tools.get_weather({unit: "K"}); } catch (e) { return [e.name, e.tool, e.message]; }
    """
    _, result, _ = agent_run(tmp_path, [[exec_item(program)], [text_item("ok")]])
    name, tool, message = json.loads(exec_results(result)[0].result_text)
    assert (name, tool) == ("ToolError", "get_weather")
    assert "invalid arguments for tool 'get_weather'" in message and "city" in message and "unit" in message


def test_an_uncaught_rejection_is_an_error_result_with_the_js_stack(tmp_path):
    _, result, _ = agent_run(tmp_path, [[exec_item("await tools.get_weather({});")], [text_item("ok")]])
    [called] = exec_results(result)
    assert called.is_error
    assert called.result_text.startswith("the program failed:\nToolError: invalid arguments for tool 'get_weather'")
    assert "    at " in called.result_text


def test_approval_policy_applies_to_shell_calls_made_from_code(tmp_path):
    sandbox_dir = tmp_path / "work"
    sandbox_dir.mkdir()
    shell = ShellTool.from_config(HarnessConfig(approval="on-request", sandbox_dir="."), base_dir=sandbox_dir)
    program = """
        const listed = await tools.shell({command: "ls"});
        try { await tools.shell({command: "touch pwned"}); return "ran"; }
        catch (e) { return {listed: typeof listed, denied: e.message}; }
    """
    _, result, _ = agent_run(tmp_path, [[exec_item(program)], [text_item("ok")]], tools=(shell,))
    outcome = json.loads(exec_results(result)[0].result_text)
    assert outcome["listed"] in ("object", "string")
    assert "approval" in outcome["denied"].lower() or "denied" in outcome["denied"].lower()
    assert not (sandbox_dir / "pwned").exists()


class _DenyNotes(Plugin):
    """A tool middleware standing for an approval policy: add_note is never allowed."""

    name = "deny_notes"
    layers = (Layer.HARNESS,)
    seen: ClassVar[list[str]] = []

    @hookimpl
    def loopstack_tool_middleware(self, runtime):
        def wrap(next_handler):
            async def handler(call, ctx):
                _DenyNotes.seen.append(call.name)
                if call.name == "add_note":
                    return ToolResult("denied by policy: add_note needs approval", is_error=True)
                return await next_handler(call, ctx)

            return handler

        return wrap


def test_tool_middleware_sees_and_can_deny_every_call_made_from_code(tmp_path):
    from loopstack import PluginCatalog

    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(_DenyNotes, source="tests")
    runtime = runtime_for(tmp_path, CODE_MODE_ON + "[plugins.deny_notes]\nenabled = true\n", catalog)
    _DenyNotes.seen = []
    program = """
        await tools.get_weather({city: "Paris"});
        try { await tools.add_note({title: "x"}); } catch (e) { return e.message; }
    """
    _, result, _ = agent_run(tmp_path, [[exec_item(program)], [text_item("ok")]], runtime=runtime)
    assert exec_results(result)[0].result_text == '"denied by policy: add_note needs approval"'
    assert _DenyNotes.seen == ["exec", "get_weather", "add_note"]


def test_session_context_keeps_stored_values_between_programs(tmp_path):
    table = CODE_MODE_ON + 'context = "session"\n'
    outputs = [
        [exec_item("store('cities', ['Paris', 'Oslo']); globalThis.scratch = 1; return 'stored'", "c1")],
        [exec_item("return [load('cities'), load('missing') === undefined, typeof scratch]", "c2")],
        [text_item("ok")],
    ]
    model, result, _ = agent_run(tmp_path, outputs, table=table)
    assert "store(key, value)" in model.requests[0]["tools"][-1]["description"]
    texts = [e.result_text for e in exec_results(result)]
    assert texts == ['"stored"', '[["Paris","Oslo"],true,"number"]']


def _session_sandbox(agent):
    return agent.session.state(SESSION_CONTEXTS).sandbox


@pytest.mark.parametrize("ending", ["close", "garbage"])
def test_session_context_is_disposed_with_its_session(tmp_path, ending):
    table = CODE_MODE_ON + 'context = "session"\n'
    runtime = runtime_for(tmp_path, table)
    outputs = [[exec_item("store('k', 1); return 'ok'", "c1")], [text_item("ok")]]

    async def main():
        agent = Agent(ScriptedModel(outputs), [get_weather], instructions="Use tools.", runtime=runtime)
        await agent.run("task")
        sandbox = _session_sandbox(agent)
        assert sandbox is not None and not sandbox.is_closed
        if ending == "close":
            agent.session.close()
            agent.session.close()  # twice is harmless
        else:  # a server's per-request Session simply goes away
            del agent
            gc.collect()
        await asyncio.sleep(0)  # the disposal is scheduled on the sandbox's loop
        return sandbox

    assert run(main).is_closed


def test_exec_context_is_fresh_for_every_program(tmp_path):
    outputs = [
        [exec_item("globalThis.scratch = 1; return typeof store", "c1")],
        [exec_item("return typeof scratch", "c2")],
        [text_item("ok")],
    ]
    _, result, _ = agent_run(tmp_path, outputs)
    assert [e.result_text for e in exec_results(result)] == ['"function"', '"undefined"']


def test_exec_rejects_arguments_other_than_code(tmp_path):
    _, result, _ = agent_run(tmp_path, [[call_item("exec", {"program": "return 1"}, "c1")], [text_item("ok")]])
    [called] = exec_results(result)
    assert called.is_error and "code" in called.result_text


@pytest.mark.parametrize("table", ["", CODE_MODE_ON.replace("true", "false")])
def test_without_the_plugin_there_is_no_exec(tmp_path, table):
    model, _, _ = agent_run(tmp_path, [[text_item("hi")]], table=table or "[stack]\nname = 'bare'\n")
    assert model.tool_names() == ["get_weather", "add_note"]


def test_with_the_tool_search_plugin_programs_search_then_call_what_they_found(tmp_path):
    table = CODE_MODE_ON + """code_mode_only = true

[plugins.tool_search]
enabled = true
defer = "all"
count_schema_tokens = false
"""
    outputs = [
        [exec_item("return await tools.tool_search({query: 'weather in a city'})", "c1")],
        [exec_item("return (await tools.get_weather({city: 'Kyiv', unit: 'F'})).unit", "c2")],
        [text_item("ok")],
    ]
    model, result, _ = agent_run(tmp_path, outputs, table=table)
    assert sorted(model.tool_names()) == ["exec", "tool_search"]
    found_json, unit = [e.result_text for e in exec_results(result)]
    found = json.loads(found_json)
    assert found.startswith("Loaded 1 tool(s)")
    assert "get_weather" in found and "get_weather(args: {" in found and 'unit?: "C" | "F";' in found
    assert unit == '"F"'
