"""The API part of ``loopstack demo``: a real server on loopback, a tool-calling exchange."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:  # loopback only
        return json.loads(response.read()), time.perf_counter() - started


def _usage(response: dict[str, Any], elapsed: float) -> str:
    usage = response["usage"]
    return (f"{usage['input_tokens']} input tokens ({usage['input_tokens_details']['cached_tokens']} cached), "
            f"{usage['output_tokens']} output tokens, {elapsed * 1000:.0f} ms")


def run_api_demo(stack_ref: str, engine: Any, say: Any) -> None:
    """Serve ``stack_ref`` on ``engine`` at 127.0.0.1:<free port> and run one tool round trip."""
    import tempfile

    from .api.server import ServerThread, build_state

    with tempfile.TemporaryDirectory() as folder:
        state = build_state(stack_ref, engine=engine, store_path=f"{folder}/responses.sqlite3")
        server = ServerThread(state).start()
        try:
            url = f"{server.url}/v1/responses"
            say(f"  serving on {server.url} (Responses API, SSE, WebSocket; store in SQLite)")
            first, elapsed = _post(url, {"input": "What's the weather in Paris right now?", "tools": [WEATHER_TOOL],
                                         "tool_choice": "required", "temperature": 0, "max_output_tokens": 60})
            call = next(item for item in first["output"] if item["type"] == "function_call")
            say(f"  model -> function_call {call['name']}({call['arguments']})   [{_usage(first, elapsed)}]")
            result = "18 degrees Celsius and sunny"
            say(f"  tool  -> {result}")
            second, elapsed = _post(url, {
                "previous_response_id": first["id"], "tools": [WEATHER_TOOL], "tool_choice": "none",
                "temperature": 0, "max_output_tokens": 40,
                "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": result}]})
            text = " ".join(part["text"] for item in second["output"] if item["type"] == "message"
                            for part in item["content"])
            say(f"  model -> {text.strip()!r}   [{_usage(second, elapsed)}]")
        finally:
            server.stop()
            state.store.close()
            state.live.close()
