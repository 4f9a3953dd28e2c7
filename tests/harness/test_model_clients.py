"""Every model client drives the same agent loop: WebSocket, Chat Completions, embedded.

The real default model behind the real server (or in process) makes the tool call
(``tool_choice`` required on the first turn) and then answers from the tool's result.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from loopstack.harness.agent import Agent
from loopstack.harness.clients.base import ModelClientError
from loopstack.harness.clients.chat import ChatCompletionsClient
from loopstack.harness.clients.embedded import EmbeddedClient
from loopstack.harness.clients.websocket import ResponsesWebSocketClient
from loopstack.harness.events import FinalAnswer, ModelCalled, ToolCalled
from loopstack.harness.tools.tool import python_tool


@python_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return "18 degrees and sunny"


async def _weather_session(client: Any, *, stream: bool = False) -> Any:
    deltas: list[str] = []
    agent = Agent(client, [get_weather], instructions="You are a helpful assistant.", tool_choice_first="required",
                  max_turns=3, max_output_tokens=48, on_text_delta=deltas.append if stream else None)
    with anyio.fail_after(240):
        result = await agent.run("What's the weather in Paris right now?")
    return result, deltas


def _assert_one_call_then_answer(result: Any) -> None:
    calls = [e for e in result.events if isinstance(e, ToolCalled)]
    assert [(e.name, e.arguments, e.is_error) for e in calls] == [("get_weather", {"city": "Paris"}, False)]
    assert isinstance(result.events[-1], FinalAnswer) and result.final_text
    model_calls = [e for e in result.events if isinstance(e, ModelCalled)]
    assert len(model_calls) == 2 and all(e.usage.input_tokens > 0 and e.request_bytes > 0 for e in model_calls)
    assert model_calls[1].usage.cached_tokens > 0  # the second request extends the first: a prefix-cache hit


@pytest.mark.slow
def test_websocket_client_runs_the_loop_on_one_connection(server):
    async def main():
        async with ResponsesWebSocketClient(f"{server.url}/v1") as client:
            result, deltas = await _weather_session(client, stream=True)
            return result, deltas, client.statistics()

    result, deltas, stats = anyio.run(main)
    _assert_one_call_then_answer(result)
    assert "".join(deltas).strip() and stats.num_requests == 2 and stats.connection_setups == 1


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_client_runs_the_loop(server, stream):
    async def main():
        async with ChatCompletionsClient(f"{server.url}/v1") as client:
            return await _weather_session(client, stream=stream)

    result, deltas = anyio.run(main)
    _assert_one_call_then_answer(result)
    assert bool("".join(deltas)) is stream


@pytest.mark.slow
def test_embedded_client_runs_the_loop_in_process():
    async def main():
        async with EmbeddedClient.from_stack("baseline") as client:
            result, _ = await _weather_session(client)
            with pytest.raises(ModelClientError) as caught:
                await client.create({"input": "hi", "temperature": 9}, Agent(client, [], instructions="").runtime.context())
            return result, caught.value

    result, error = anyio.run(main)
    _assert_one_call_then_answer(result)
    assert error.status == 400 and "temperature" in error.message


def test_websocket_client_reports_a_refused_upgrade_and_bad_urls(server):
    async def main():
        client = ResponsesWebSocketClient(f"{server.url}/v1/models")  # no WebSocket route there
        ctx = Agent(client, [], instructions="").runtime.context()
        with pytest.raises(ModelClientError) as caught:
            await client.create({"input": "hi"}, ctx)
        await client.aclose()
        return caught.value

    error = anyio.run(main)
    assert error.status >= 400 and "refused" in error.message
    with pytest.raises(ValueError, match="ws://"):
        ResponsesWebSocketClient("ftp://127.0.0.1/v1")


def test_websocket_client_surfaces_error_events_and_keeps_the_connection(server):
    async def main():
        async with ResponsesWebSocketClient(f"{server.url}/v1") as client:
            ctx = Agent(client, [], instructions="").runtime.context()
            with pytest.raises(ModelClientError) as caught:
                await client.create({"input": "hi", "tool_choice": "required"}, ctx)  # no tools: refused
            response = await client.create({"input": "Say hi.", "max_output_tokens": 4}, ctx)
            return caught.value, response, client.statistics()

    error, response, stats = anyio.run(main)
    assert error.status == 400 and error.code
    assert response["status"] in ("completed", "incomplete") and stats.connection_setups == 1
