"""Chat Completions messages as the Responses input items the response chain reads."""

from __future__ import annotations

from loopstack.api.conversation import chat_messages
from loopstack.api.routes.chat_completions import chat_items, failure_error


def test_messages_become_items_with_tool_calls_and_results():
    messages = chat_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ])
    assert chat_items(messages) == [
        {"type": "message", "role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
    ]


def test_a_tripped_guard_is_a_400_that_keeps_the_verdict():
    error = failure_error({"status": "failed", "error": {"code": "guard_tripped", "message": "blocked", "guard": "g",
                                                     "stage": "input", "score": 0.9}})
    assert error.status == 400
    assert error.body()["error"] == {"guard": "g", "stage": "input", "score": 0.9, "message": "blocked",
                                     "type": "invalid_request_error", "param": None, "code": "guard_tripped"}
    assert failure_error({"status": "failed", "error": {"code": "invalid_request", "message": "too long"}}).status == 400
    assert failure_error({"status": "failed", "error": {"message": "engine died"}}).status == 500
