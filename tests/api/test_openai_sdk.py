"""The official openai SDK against the real server and the real small model."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_plain_response(client):
    response = client.responses.create(model="smollm2-135m-instruct", input="What is the capital of France?",
                                       temperature=0, max_output_tokens=24)
    assert response.status == "completed"
    assert "Paris" in response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage.input_tokens_details.cached_tokens >= 0


def test_streaming_response(client):
    deltas, kinds, final = [], [], None
    with client.responses.stream(model="m", input="What is the capital of France?", temperature=0,
                                 max_output_tokens=24) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "Paris" in "".join(deltas) and final.output_text.strip() == "".join(deltas).strip()


def test_tool_call_and_tool_result_round_trip(client):
    first = client.responses.create(model="m", input="What's the weather in Paris right now?", tools=[WEATHER_TOOL],
                                    tool_choice="required", temperature=0, max_output_tokens=60)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = client.responses.create(
        model="m", previous_response_id=first.id, tools=[WEATHER_TOOL], temperature=0, max_output_tokens=40,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}],
        tool_choice="none",
    )
    # a small model may ramble up to max_output_tokens: incomplete is a fine end here
    assert second.status in ("completed", "incomplete") and second.output_text.strip()
    assert not [item for item in second.output if item.type == "function_call"]
    # the chain's prefix was cached by the first call
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_chains_the_conversation(client):
    first = client.responses.create(model="m", input="My name is Ada. Say hello.", temperature=0, max_output_tokens=16)
    second = client.responses.create(model="m", previous_response_id=first.id, input="What is my name?",
                                     temperature=0, max_output_tokens=16)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16


def test_get_and_delete_a_stored_response(client):
    created = client.responses.create(model="m", input="Hi", temperature=0, max_output_tokens=4)
    assert client.responses.retrieve(created.id).id == created.id
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_chat_completions_plain_and_streaming(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    completion = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=24)
    assert "Paris" in completion.choices[0].message.content
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert "Paris" in text and usage.completion_tokens > 0


def test_chat_completions_with_a_required_tool(client):
    tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    completion = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What's the weather in Paris right now?"}],
        tools=[tool], tool_choice="required", temperature=0, max_tokens=60)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_text_format_json_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model="m", input="What's the weather in Paris right now?", temperature=0,
                                       max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "w", "schema": schema,
                                                        "strict": True}})
    assert json.loads(response.output_text) == {"city": "Paris"}
