"""The Responses API as current clients (Codex CLI, the openai SDK) send it: namespace tools,
hosted tools, ``store: false``, ``include``, ``reasoning``, and WebSocket mode's prewarm
(``generate: false``). Checked through the openai SDK's own types against a real server on
loopback over a scripted engine (the real tokenizer and server; the "model" says what the test
scripts, so a call to a namespaced function can be asserted token for token)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.scripted_api import ScriptedAPI, real_tokenizer

openai = pytest.importorskip("openai")

CRM = {
    "type": "namespace", "name": "crm", "description": "Customer records.",
    "tools": [
        {"type": "function", "name": "lookup", "description": "Find a customer by email.", "strict": False,
         "parameters": {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]}},
        {"type": "function", "name": "close_ticket", "description": "Close a support ticket.",
         "parameters": {"type": "object", "properties": {"ticket": {"type": "integer"}}}},
    ],
}
SHELL = {"type": "function", "name": "exec_command", "description": "Run a shell command.", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return real_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer: Any) -> Iterator[ScriptedAPI]:
    server = ScriptedAPI("baseline", tokenizer)
    yield server
    server.close()


@pytest.fixture
def rejecting(tokenizer: Any, tmp_path: Any) -> Iterator[ScriptedAPI]:
    stack = tmp_path / "reject.toml"
    stack.write_text('[stack]\nname = "reject"\nextends = "baseline"\n[api]\nhosted_tools = "reject"\n')
    server = ScriptedAPI(stack, tokenizer)
    yield server
    server.close()


# -- namespace tools -----------------------------------------------------------------------

def test_the_model_sees_a_namespace_functions_by_qualified_name(served):
    served.client.responses.create(model="m", input="Find ana@example.com", tools=[SHELL, CRM])
    prompt = served.last_prompt()
    assert '"name": "crm.lookup"' in prompt and '"name": "crm.close_ticket"' in prompt
    assert '"name": "exec_command"' in prompt


def test_a_call_to_a_namespace_function_names_the_namespace_apart(served):
    served.push(call_text("crm.lookup", {"email": "ana@example.com"}))
    response = served.client.responses.create(model="m", input="Find ana@example.com", tools=[SHELL, CRM])
    [call] = response.output  # parsed by the SDK: a ResponseFunctionToolCall
    assert (call.type, call.namespace, call.name) == ("function_call", "crm", "lookup")
    assert json.loads(call.arguments) == {"email": "ana@example.com"}


def test_streamed_events_carry_the_namespace(served):
    served.push(call_text("crm.close_ticket", {"ticket": 7}))
    with served.client.responses.stream(model="m", input="Close ticket 7", tools=[CRM]) as stream:
        added = [e.item for e in stream if e.type == "response.output_item.added"]
        final = stream.get_final_response()
    assert (added[0].namespace, added[0].name) == ("crm", "close_ticket")
    assert (final.output[0].namespace, final.output[0].name) == ("crm", "close_ticket")


def test_a_namespaced_call_and_its_output_round_trip(served):
    served.push(call_text("crm.lookup", {"email": "ana@example.com"}))
    first = served.client.responses.create(model="m", input="Find ana@example.com", tools=[CRM], store=False)
    call = first.output[0]
    served.push("Ana is customer 42.")
    second = served.client.responses.create(model="m", tools=[CRM], input=[
        {"type": "message", "role": "user", "content": "Find ana@example.com"},
        {"type": "function_call", "call_id": call.call_id, "namespace": call.namespace, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "customer 42: Ana"},
    ])
    prompt = served.last_prompt()
    assert '"name": "crm.lookup"' in prompt.split("Find ana@example.com")[-1]  # the call, as the model wrote it
    assert "customer 42: Ana" in prompt
    assert second.output_text == "Ana is customer 42."


def test_a_namespace_without_tools_is_a_400_naming_the_tool(served):
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.responses.create(model="m", input="hi", tools=[{"type": "namespace", "name": "crm"}])
    assert caught.value.body["param"] == "tools" and "tools[0]" in caught.value.body["message"]


# -- hosted tools ----------------------------------------------------------------------------

def test_hosted_tools_are_omitted_with_a_warning_by_default(served, caplog):
    with caplog.at_level(logging.WARNING, logger="loopstack.api.service"):
        response = served.client.responses.create(model="m", input="hi", tools=[SHELL, WEB_SEARCH])
    assert response.status == "completed"
    assert "web_search" in caplog.text and "omit" in caplog.text
    assert "web_search" not in served.last_prompt()


def test_a_rejecting_stack_names_the_hosted_tool(rejecting):
    with pytest.raises(openai.BadRequestError) as caught:
        rejecting.client.responses.create(model="m", input="hi", tools=[SHELL, WEB_SEARCH])
    body = caught.value.body
    assert body["code"] == "unsupported_tool" and body["param"] == "tools" and "'web_search'" in body["message"]
    assert rejecting.prompts == []  # refused before anything ran


# -- request fields ----------------------------------------------------------------------------

def test_store_false_stores_nothing(served):
    response = served.client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.responses.create(model="m", input="again", previous_response_id=response.id)
    assert caught.value.body["code"] == "previous_response_not_found"


def test_codex_fields_are_accepted_and_reasoning_is_echoed(served):
    served.push("Hello.")
    response = served.client.responses.create(
        model="m", input="Say hello", reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content"], parallel_tool_calls=True, prompt_cache_key="thread-1",
        extra_body={"client_metadata": {"x-codex-turn-metadata": "{}"}}, store=False)
    assert response.output_text == "Hello." and [item.type for item in response.output] == ["message"]
    assert response.reasoning.effort == "low" and response.reasoning.summary == "auto"


def test_an_unknown_include_value_is_a_400_naming_the_field(served):
    reply = httpx.post(f"{served.url}/responses", json={"model": "m", "input": "hi", "include": ["everything"]})
    assert reply.status_code == 400 and "include" in reply.json()["error"]["param"]


# -- prewarm -----------------------------------------------------------------------------------

def test_generate_false_fills_the_cache_and_outputs_nothing(served):
    served.push("this text must not come back")
    before = len(served.prompts)
    warm = served.client.responses.create(model="m", input="You are terse.", extra_body={"generate": False})
    assert warm.status == "completed" and warm.output == [] and warm.usage.output_tokens == 0
    assert len(served.prompts) == before + 1  # the prompt was prefilled
    served.push("Hi.")
    turn = served.client.responses.create(model="m", input="Hello", previous_response_id=warm.id)
    assert turn.output_text == "Hi." and "You are terse." in served.last_prompt()


# -- the stack's output budget -------------------------------------------------------------


def test_a_request_without_an_output_limit_gets_the_stacks(tokenizer, served, tmp_path):
    """``[api] max_output_tokens`` and ``temperature``: what a request that sets none gets (Codex
    sends neither), on both endpoints and in the echoed response; a request's own value wins."""
    stack = tmp_path / "budget.toml"
    stack.write_text('[stack]\nname = "budget"\nextends = "baseline"\n[api]\nmax_output_tokens = 77\ntemperature = 0\n')
    server = ScriptedAPI(stack, tokenizer)
    try:
        server.client.responses.create(model="m", input="hi")
        server.client.responses.create(model="m", input="hi", max_output_tokens=20)
        server.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        server.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=9)
        server.client.responses.create(model="m", input="hi", temperature=0.7)
        params = server.engine.params
        assert [p.max_tokens for p in params] == [77, 20, 77, 9, 77]
        assert [p.temperature for p in params] == [0, 0, 0, 0, 0.7]  # the stack's, unless the request's
        echoed = server.client.responses.create(model="m", input="hi")
        assert echoed.temperature == 0 and echoed.top_p == 1.0
    finally:
        server.close()
    served.client.responses.create(model="m", input="hi")  # baseline, without the options: the API's defaults
    default = served.engine.params[-1]
    assert (default.max_tokens, default.temperature, default.top_p) == (1024, 1.0, 1.0)
