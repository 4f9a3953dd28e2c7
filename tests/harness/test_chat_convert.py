"""Responses requests to Chat Completions bodies and back."""

from __future__ import annotations

import pytest

from loopstack.harness.clients.chat_convert import chat_body, response_of_chat


def test_request_maps_roles_calls_outputs_tools_and_settings():
    request = {
        "model": "m", "instructions": "Be brief.", "prompt_cache_key": "session-1", "max_output_tokens": 32, "temperature": 0.0, "seed": 7,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": {"city": "Rome"}},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {"type": "tool_search_output", "call_id": "c2", "output": "found 1",
             "tools": [{"type": "function", "name": "x"}]},
            {"type": "message", "role": "developer", "content": "note"},
        ],
    }
    body = chat_body(request)
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "system"]
    assistant = body["messages"][2]
    assert assistant["content"] == "Let me look." and [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert assistant["tool_calls"][1]["function"]["arguments"] == '{"city": "Rome"}'
    assert body["messages"][4]["content"].startswith("found 1\n") and '"name": "x"' in body["messages"][4]["content"]
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (32, 0.0, 7)
    assert body["prompt_cache_key"] == "session-1"
    assert body["response_format"]["json_schema"] == {"name": "out", "schema": {"type": "object"}, "strict": True}


def test_unknown_item_type_is_named():
    with pytest.raises(ValueError, match=r"input\[0\].*'reasoning'"):
        chat_body({"input": [{"type": "reasoning"}]})


def test_completion_maps_back_to_a_response():
    completion = {"id": "x", "model": "m", "choices": [{"finish_reason": "length", "message": {
        "content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                  "prompt_tokens_details": {"cached_tokens": 8}}}
    response = response_of_chat(completion, model="m")
    assert response["status"] == "incomplete"
    assert [i["type"] for i in response["output"]] == ["message", "function_call"]
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 8
