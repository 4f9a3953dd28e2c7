"""WebSocket mode: a 10-turn tool-calling conversation on one connection, bad messages."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid"]


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def run_response(ws, **fields) -> tuple[list[str], dict]:
    ws.send(json.dumps({"type": "response.create", **fields}))
    kinds = []
    while True:
        event = json.loads(ws.recv(timeout=120))
        kinds.append(event["type"])
        if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return kinds, event


def test_ten_turn_tool_conversation_on_one_connection(server):
    previous = None
    with connect(ws_url(server)) as ws:
        for turn, city in enumerate(CITIES):
            kinds, done = run_response(ws, input=f"What's the weather in {city} right now?", tools=[WEATHER_TOOL],
                                       tool_choice="required", temperature=0, max_output_tokens=40,
                                       previous_response_id=previous)
            assert done["type"] == "response.completed", done
            [call] = [i for i in done["response"]["output"] if i["type"] == "function_call"]
            assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": city}
            assert "response.function_call_arguments.done" in kinds
            kinds, done = run_response(
                ws, previous_response_id=done["response"]["id"], tools=[WEATHER_TOOL], tool_choice="none",
                temperature=0, max_output_tokens=24,
                input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "20 degrees, clear"}])
            assert done["type"] in ("response.completed", "response.incomplete"), done
            assert done["response"]["output"][0]["type"] == "message"
            assert done["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0
            previous = done["response"]["id"]


def test_a_call_streams_its_arguments_as_the_model_writes_them(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "response.create", "input": "What's the weather in Paris right now?",
                            "tools": [WEATHER_TOOL], "tool_choice": "required", "temperature": 0,
                            "max_output_tokens": 40}))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.incomplete", "error"):
            events.append(json.loads(ws.recv(timeout=120)))
    kinds = [e["type"] for e in events]
    assert events[-1]["type"] == "response.completed", events[-1]
    added = kinds.index("response.output_item.added")
    assert events[added]["item"]["type"] == "function_call" and events[added]["item"]["status"] == "in_progress"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = kinds.index("response.function_call_arguments.done")
    # the model's tokens arrive as they come (several deltas, all before .done), and together
    # they are the arguments the completed call carries
    assert len(deltas) > 1 and max(i for i, k in enumerate(kinds) if k.endswith("arguments.delta")) < done
    [call] = [i for i in events[-1]["response"]["output"] if i["type"] == "function_call"]
    assert json.loads("".join(deltas)) == json.loads(call["arguments"]) == {"city": "Paris"}
    assert events[done]["arguments"] == call["arguments"] and call["id"] == events[added]["item"]["id"]


def test_store_false_chains_live_on_the_connection(server):
    with connect(ws_url(server)) as ws:
        _, first = run_response(ws, input="Say hi.", store=False, temperature=0, max_output_tokens=8)
        _, second = run_response(ws, input="Again.", store=False, temperature=0, max_output_tokens=8,
                                 previous_response_id=first["response"]["id"])
        assert second["type"] in ("response.completed", "response.incomplete")
    with connect(ws_url(server)) as ws:  # another connection does not see it
        _, third = run_response(ws, input="x", previous_response_id=first["response"]["id"], max_output_tokens=4)
        assert third["type"] == "error" and third["error"]["code"] == "previous_response_not_found"


def test_invalid_messages_get_errors_and_the_connection_stays_usable(server):
    with connect(ws_url(server)) as ws:
        ws.send("not json")
        assert json.loads(ws.recv(timeout=30))["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "session.update"}))
        assert json.loads(ws.recv(timeout=30))["error"]["param"] == "type"
        ws.send(json.dumps({"type": "response.create", "input": "hi", "temperature": "hot"}))
        assert json.loads(ws.recv(timeout=30))["error"]["param"] == "temperature"
        _, done = run_response(ws, input="What is the capital of France?", temperature=0, max_output_tokens=16)
        assert done["type"] == "response.completed"


def test_binary_frames_close_with_a_clear_code(server):
    with connect(ws_url(server)) as ws:
        ws.send(b"\x00\x01")
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=30)
    assert info.value.rcvd.code == 1003
