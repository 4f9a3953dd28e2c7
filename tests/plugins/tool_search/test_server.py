"""The server side of tool search: ``tool_search_output`` items render as the tool response
with the loaded schemas, calls to loaded tools are accepted, and the prompt of each turn is
a prefix of the next one's (the engine's prefix cache stays valid)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import anyio
import pytest

from loopstack.api.auth import Principal
from loopstack.api.conversation import (
    ConversationError,
    items_to_messages,
    loaded_tools,
    render_prompt,
)
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.service import ResponsesService
from loopstack.api.store import ResponseStore
from loopstack.harness.agent import Agent
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from tests.plugins.tool_search.support import (
    ON,
    ScriptedModel,
    answer,
    call,
    github_tools,
    needs_model,
    runtime_with,
)

TOOL = {"type": "function", "name": "create_issue", "description": "Open an issue",
        "parameters": {"type": "object", "properties": {"title": {"type": "string"}}}}


def _items(*tools):
    return [
        {"type": "message", "role": "user", "content": "file a bug"},
        {"type": "function_call", "call_id": "c1", "name": SEARCH_TOOL_NAME, "arguments": '{"query": "issue"}'},
        {"type": "tool_search_output", "call_id": "c1", "output": "Loaded 1 tool(s)", "tools": list(tools)},
    ]


def test_a_search_output_renders_as_the_tool_response_with_the_schemas():
    messages = items_to_messages("Be brief.", _items(TOOL))
    last = messages[-1]
    assert last["role"] == "tool" and last["tool_call_id"] == "c1" and last["name"] == SEARCH_TOOL_NAME
    text, block = last["content"].split("\n", 1)
    assert text == "Loaded 1 tool(s)"
    assert block == ('<tools>\n{"type": "function", "function": {"name": "create_issue", "description": '
                     '"Open an issue", "parameters": {"type": "object", "properties": {"title": {"type": "string"}}}}}'
                     "\n</tools>")
    assert items_to_messages(None, _items())[-1]["content"] == "Loaded 1 tool(s)"  # nothing loaded: just text


def test_bad_search_outputs_name_the_item():
    with pytest.raises(ConversationError, match=r"input\[2\]\.tools\[0\]"):
        items_to_messages(None, _items({"type": "web_search"}))
    broken = _items(TOOL)
    del broken[2]["call_id"]
    with pytest.raises(ConversationError, match=r"input\[2\].*'call_id'"):
        items_to_messages(None, broken)


def test_a_search_output_in_the_apis_shape_has_only_its_tools():
    api_shaped = _items(TOOL)
    del api_shaped[2]["output"]  # the server's hosted search returns no text, only the loaded tools
    assert items_to_messages(None, api_shaped)[-1]["content"].startswith('<tools>\n{"type": "function"')


def test_loaded_tools_lists_each_name_once():
    again = {**TOOL, "description": "second copy"}
    items = [*_items(TOOL), *_items(again)[1:]]
    assert [(t.name, t.description) for t in loaded_tools(items)] == [("create_issue", "Open an issue")]
    assert loaded_tools("just a string") == []


@needs_model
def test_the_server_accepts_calls_to_loaded_tools():
    from loopstack.plugins.tool_search.schema_tokens import tokenizer

    engine = SimpleNamespace(tokenizer=tokenizer(), max_model_len=8192)
    with ResponseStore(":memory:", ttl_s=60) as store:
        service = ResponsesService(engine, store, model_name="m")  # type: ignore[arg-type]
        tools = [{"type": "function", "name": SEARCH_TOOL_NAME, "parameters": {"type": "object", "properties": {}}}]
        request = ResponsesRequest.model_validate({"model": "m", "input": _items(TOOL), "tools": tools})
        prepared = service.prepare(request, Principal("k", "t"))
    assert prepared.tool_names == {SEARCH_TOOL_NAME, "create_issue"}


@needs_model
def test_each_prompt_is_a_prefix_of_the_next_after_a_search(tmp_path):
    from loopstack.plugins.tool_search.schema_tokens import tokenizer

    model = ScriptedModel([
        [call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 2}, "c1")],
        [call("create_issue", {"owner": "acme", "repo": "app", "title": "crash"}, "c2")],
        [answer("filed")],
    ])
    agent = Agent(model, github_tools(), instructions="Use tools.", runtime=runtime_with(tmp_path, ON))
    anyio.run(agent.run, "open an issue about the crash")
    prompts = [render_prompt(tokenizer(), items_to_messages(r["instructions"], r["input"]), r["tools"],
                             add_generation_prompt=False) for r in model.requests]
    assert len(prompts) == 3
    for before, after in itertools.pairwise(prompts):
        assert after.startswith(before) and len(after) > len(before)
    assert '"name": "create_issue"' in prompts[1][len(prompts[0]):]  # the schema arrived after the prefix
