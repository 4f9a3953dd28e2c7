"""The hosted ``tool_search`` over ``defer_loading`` tools, run by the server with the ``tool_search``
plugin's index: any client gets deferred tool discovery. A real server on loopback over a
scripted engine (a test double of the model: it searches, then calls what the search loaded),
read back through the openai SDK's own types."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.api.scripted_api import ScriptedAPI, real_tokenizer

openai = pytest.importorskip("openai")

EMAIL = {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]}
TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a shell command.",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
    {"type": "namespace", "name": "crm", "description": "Customer records.", "defer_loading": True, "tools": [
        {"type": "function", "name": "lookup", "description": "Find a customer record by email address.",
         "parameters": EMAIL},
        {"type": "function", "name": "close_ticket", "description": "Close a support ticket by number.",
         "parameters": {"type": "object", "properties": {"ticket": {"type": "integer"}}}},
    ]},
    {"type": "function", "name": "send_invoice", "description": "Email an invoice PDF to a billing contact.",
     "defer_loading": True, "parameters": EMAIL},
    {"type": "tool_search"},
]
SEARCH = '<tool_call>\n{"name": "tool_search", "arguments": {"query": "find a customer by email", "limit": 1}}\n</tool_call>'
LOOKUP = '<tool_call>\n{"name": "crm.lookup", "arguments": {"email": "ana@example.com"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return real_tokenizer()


def searching_model(prompt: str) -> str:
    """Search first; once the search's output is in the prompt, call what it loaded; after that
    call's output, answer."""
    if "customer 42" in prompt:
        return "Ana is customer 42."
    return LOOKUP if '"name": "crm.lookup"' in prompt else SEARCH


def stack_file(tmp_path: Any, name: str, body: str) -> Any:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[stack]\nname = "{name}"\nextends = "baseline"\n{body}')
    return path


@pytest.fixture
def served(tokenizer: Any, tmp_path: Any) -> Iterator[ScriptedAPI]:
    stack = stack_file(tmp_path, "search", '[plugins.tool_search]\nenabled = true\nretriever = "bm25"\n')
    server = ScriptedAPI(stack, tokenizer, searching_model)
    yield server
    server.close()


def test_deferred_tools_stay_out_of_the_prompt_until_a_search_loads_them(served):
    response = served.client.responses.create(model="m", input="Find ana@example.com", tools=TOOLS, store=False)
    first, second = served.prompts
    assert '"name": "tool_search"' in first and '"name": "exec_command"' in first
    assert "lookup" not in first and "send_invoice" not in first  # deferred: no schema up front
    assert "crm" in first  # the search function's description names the namespaces it can load
    call, output, function_call = response.output  # parsed by the SDK into its own item types
    assert (call.type, call.execution, call.status) == ("tool_search_call", "server", "completed")
    assert call.arguments == {"query": "find a customer by email", "limit": 1}
    assert (output.type, output.call_id) == ("tool_search_output", call.call_id)
    [namespace] = output.tools
    assert (namespace.type, namespace.name, [t.name for t in namespace.tools]) == ("namespace", "crm", ["lookup"])
    assert '"name": "crm.lookup"' in second and "send_invoice" not in second  # loaded: the best match only
    assert (function_call.type, function_call.namespace, function_call.name) == ("function_call", "crm", "lookup")
    assert response.usage.input_tokens > len(first) // 8  # both rounds' prompts are billed


def test_a_later_turn_keeps_the_loaded_tools_callable_and_the_prefix_unchanged(served):
    first = served.client.responses.create(model="m", input="Find ana@example.com", tools=TOOLS, store=False)
    call = first.output[-1]
    history = [{"type": "message", "role": "user", "content": "Find ana@example.com"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "customer 42: Ana"}]
    second = served.client.responses.create(model="m", input=history, tools=TOOLS, store=False)
    assert second.output_text == "Ana is customer 42."
    round_two, turn_two = served.prompts[1], served.prompts[2]
    assert turn_two.startswith(round_two.rsplit("<|im_start|>assistant", 1)[0])  # append-only: the cache holds


def test_streamed_events_carry_the_search_items(served):
    with served.client.responses.stream(model="m", input="Find ana@example.com", tools=TOOLS) as stream:
        added = [e.item.type for e in stream if e.type == "response.output_item.added"]
        final = stream.get_final_response()
    assert added == ["tool_search_call", "tool_search_output", "function_call"]
    assert [item.type for item in final.output] == added
    assert final.tools[-1].type == "tool_search"  # the response echoes the client's tools


def test_without_a_search_plugin_deferred_tools_load_up_front(tokenizer, caplog):
    server = ScriptedAPI("baseline", tokenizer, lambda prompt: "ok")
    try:
        with caplog.at_level(logging.WARNING, logger="loopstack.api.service"):
            response = server.client.responses.create(model="m", input="hi", tools=TOOLS)
        assert response.status == "completed" and "tool_search" in caplog.text
        assert '"name": "crm.lookup"' in server.prompts[0] and '"name": "send_invoice"' in server.prompts[0]
    finally:
        server.close()


def test_a_rejecting_stack_without_a_search_names_tool_search(tokenizer, tmp_path):
    server = ScriptedAPI(stack_file(tmp_path, "reject", '[api]\nhosted_tools = "reject"\n'), tokenizer, lambda p: "ok")
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            server.client.responses.create(model="m", input="hi", tools=TOOLS)
        assert caught.value.body["code"] == "unsupported_tool" and "tool_search" in caught.value.body["message"]
    finally:
        server.close()


def test_a_search_that_finds_nothing_still_continues(tokenizer, tmp_path):
    answers = iter([SEARCH.replace("find a customer by email", "zzzz qqqq"), "Nothing fits."])
    stack = stack_file(tmp_path, "search", '[plugins.tool_search]\nenabled = true\nretriever = "bm25"\n')
    server = ScriptedAPI(stack, tokenizer, lambda prompt: next(answers))
    try:
        response = server.client.responses.create(model="m", input="hi", tools=TOOLS)
        assert [item.type for item in response.output] == ["tool_search_call", "tool_search_output", "message"]
        assert response.output[1].tools == [] and response.output_text == "Nothing fits."
        assert json.loads(json.dumps(response.output[0].arguments))["query"] == "zzzz qqqq"
    finally:
        server.close()
