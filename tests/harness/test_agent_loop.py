"""The agent loop: against the real API server and model, and against a scripted model."""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import httpx
import pytest

from loopstack import Layer, Plugin, PluginCatalog, PluginConfig, StackLoader, StackRuntime, hookimpl
from loopstack.harness.agent import Agent
from loopstack.harness.clients.base import ModelClientError
from loopstack.harness.clients.http import ResponsesHTTPClient
from loopstack.harness.events import (
    FinalAnswer,
    ModelCalled,
    ToolCalled,
    TurnLimitReached,
    TurnStarted,
)
from loopstack.harness.tools.tool import python_tool


def run(main: Callable[[], Awaitable[Any]], timeout_s: float = 10) -> Any:
    async def bounded() -> Any:
        with anyio.fail_after(timeout_s):
            return await main()

    return anyio.run(bounded)


# -- the real server and model ------------------------------------------------------------


@python_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return "18 degrees and sunny"


@pytest.mark.slow
def test_real_model_calls_the_tool_once_then_answers(server):
    async def main():
        async with ResponsesHTTPClient(f"{server.url}/v1") as client:
            agent = Agent(client, [get_weather], instructions="You are a helpful assistant.",
                          tool_choice_first="required", max_turns=3, max_output_tokens=48)
            return await agent.run("What's the weather in Paris right now?")

    result = run(main, timeout_s=240)
    tool_events = [e for e in result.events if isinstance(e, ToolCalled)]
    assert [(e.name, e.arguments, e.is_error) for e in tool_events] == [("get_weather", {"city": "Paris"}, False)]
    assert tool_events[0].result_text == "18 degrees and sunny"
    assert isinstance(result.events[-1], FinalAnswer) and result.final_text
    assert result.turns == 2
    model_calls = [e for e in result.events if isinstance(e, ModelCalled)]
    assert all(e.usage.input_tokens > 0 and e.usage.output_tokens > 0 and e.request_bytes > 0 for e in model_calls)
    assert model_calls[1].usage.cached_tokens > 0  # the second call extends the first one's prompt
    assert [i["type"] for i in result.items] == ["message", "function_call", "function_call_output", "message"]


class _CallWatcher(Plugin):
    name = "call_watcher"
    layers = (Layer.HARNESS,)
    Config = PluginConfig
    summary = "records tool calls as they stream"
    seen: ClassVar[list[tuple[str, str]]] = []

    @hookimpl
    def loopstack_tool_call_delta(self, call, ctx):
        _CallWatcher.seen.append((call.name, call.arguments))


@pytest.mark.slow
def test_over_streaming_http_a_listening_plugin_sees_the_call_as_the_model_writes_it(server, tmp_path):
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(_CallWatcher, source=__name__)
    (tmp_path / "s.toml").write_text("[plugins.call_watcher]\nenabled = true\n")
    runtime = StackRuntime(StackLoader(catalog).load(tmp_path / "s.toml"), catalog)
    _CallWatcher.seen = []

    async def main():
        async with ResponsesHTTPClient(f"{server.url}/v1") as client:
            agent = Agent(client, [get_weather], instructions="You are a helpful assistant.", runtime=runtime,
                          tool_choice_first="required", max_turns=1, max_output_tokens=48,
                          on_text_delta=lambda delta: None)  # the HTTP client streams when asked for text
            return await agent.run("What's the weather in Paris right now?")

    result = run(main, timeout_s=240)
    [called] = [e for e in result.events if isinstance(e, ToolCalled)]
    assert called.arguments == {"city": "Paris"}
    assert len(_CallWatcher.seen) > 1 and {name for name, _ in _CallWatcher.seen} == {"get_weather"}
    texts = [arguments for _, arguments in _CallWatcher.seen]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # each one the text so far
    assert json.loads(texts[-1]) == {"city": "Paris"} and not texts[0].endswith("}")


@pytest.mark.parametrize("is_streaming", [False, True])
def test_http_client_raises_the_servers_error(server, is_streaming):
    async def main():
        agent_ctx = Agent(_Scripted([]), [], instructions="").runtime.context()
        on_text_delta = (lambda delta: None) if is_streaming else None
        async with ResponsesHTTPClient(f"{server.url}/v1") as client:
            await client.create({"input": "hi", "temperature": "hot"}, agent_ctx, on_text_delta=on_text_delta)

    with pytest.raises(ModelClientError) as caught:
        run(main)
    assert caught.value.status == 400 and caught.value.code == "invalid_value"
    assert "temperature" in caught.value.message


# -- a scripted model ----------------------------------------------------------------------


def _call(name: str, arguments: dict[str, Any] | str, call_id: str) -> dict[str, Any]:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": raw}


def _text(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


class _Scripted:
    """A test double for a model: answers each request with the next scripted output."""

    def __init__(self, outputs: list[list[dict[str, Any]]]) -> None:
        self.outputs = list(outputs)
        self.requests: list[dict[str, Any]] = []

    async def create(self, request: dict[str, Any], ctx: Any) -> dict[str, Any]:
        self.requests.append(json.loads(json.dumps(request)))
        output = self.outputs.pop(0) if self.outputs else [_call("lookup", {"key": "again"}, "c-loop")]
        return {"output": output, "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                                             "output_tokens": 2}}


class _Probe:
    """Records how many tool calls are in flight at once."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.log: list[str] = []

    def tool(self, name: str, *, is_concurrency_safe: bool):
        async def body(key: str) -> str:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.log.append(f"start {key}")
            for _ in range(3):  # yield to the event loop: a concurrent sibling runs here
                await anyio.lowlevel.checkpoint()
            self.log.append(f"end {key}")
            self.in_flight -= 1
            return f"value of {key}"

        return python_tool(name=name, description="Look a key up.", is_concurrency_safe=is_concurrency_safe)(body)


def _two_calls_then_answer(name: str) -> list[list[dict[str, Any]]]:
    return [[_call(name, {"key": "a"}, "c1"), _call(name, {"key": "b"}, "c2")], [_text("done")]]


def test_concurrency_safe_calls_overlap():
    probe = _Probe()
    model = _Scripted(_two_calls_then_answer("lookup"))
    agent = Agent(model, [probe.tool("lookup", is_concurrency_safe=True)], instructions="x")
    result = run(lambda: agent.run("look up a and b"))
    assert probe.max_in_flight == 2
    assert probe.log[:2] == ["start a", "start b"]
    assert result.final_text == "done" and result.turns == 2
    outputs = [i for i in result.items if i["type"] == "function_call_output"]
    assert [(o["call_id"], o["output"]) for o in outputs] == [("c1", "value of a"), ("c2", "value of b")]


def test_unsafe_calls_run_one_after_another():
    probe = _Probe()
    model = _Scripted(_two_calls_then_answer("write"))
    agent = Agent(model, [probe.tool("write", is_concurrency_safe=False)], instructions="x")
    run(lambda: agent.run("write a and b"))
    assert probe.max_in_flight == 1
    assert probe.log == ["start a", "end a", "start b", "end b"]


def test_unknown_tool_and_bad_arguments_are_error_results_and_the_loop_continues():
    probe = _Probe()
    model = _Scripted([[_call("nope", {}, "c1"), _call("lookup", "not json", "c2")], [_text("sorry")]])
    agent = Agent(model, [probe.tool("lookup", is_concurrency_safe=True)], instructions="x")
    result = run(lambda: agent.run("go"))
    tool_events = [e for e in result.events if isinstance(e, ToolCalled)]
    assert [(e.name, e.is_error) for e in tool_events] == [("nope", True), ("lookup", True)]
    assert "unknown tool 'nope'" in tool_events[0].result_text
    assert result.final_text == "sorry"
    assert model.requests[1]["input"][-1] == {"type": "function_call_output", "call_id": "c2",
                                              "output": tool_events[1].result_text}


def test_turn_limit_emits_turn_limit_reached():
    probe = _Probe()
    agent = Agent(_Scripted([]), [probe.tool("lookup", is_concurrency_safe=True)], instructions="x", max_turns=2)
    result = run(lambda: agent.run("loop forever"))
    assert isinstance(result.events[-1], TurnLimitReached) and result.events[-1].max_turns == 2
    assert result.turns == 2 and result.final_text == ""
    assert sum(isinstance(e, TurnStarted) for e in result.events) == 2


def test_request_shape_tool_choice_and_resume():
    probe = _Probe()
    tool = probe.tool("lookup", is_concurrency_safe=True)
    model = _Scripted([[_call("lookup", {"key": "a"}, "c1")], [_text("first")], [_text("second")]])
    agent = Agent(model, [tool], instructions="Be brief.", tool_choice_first="required", max_output_tokens=32)
    first = run(lambda: agent.run("one"))
    request = model.requests[0]
    assert request["tools"] == [{"type": "function", "name": "lookup", "description": "Look a key up.",
                                 "parameters": tool.info.parameters}]
    assert (request["tool_choice"], model.requests[1]["tool_choice"]) == ("required", "auto")
    assert (request["model"], request["instructions"], request["max_output_tokens"]) == ("default", "Be brief.", 32)
    resumed = Agent(model, [tool], instructions="Be brief.", items=first.items)
    second = run(lambda: resumed.run("two"))
    assert second.final_text == "second"
    assert model.requests[2]["input"][: len(first.items)] == first.items  # append-only across runs
    events = [e for e in second.events if isinstance(e, ModelCalled)]
    assert events[0].usage.cached_tokens == 4 and events[0].request_bytes > 0


def test_http_client_posts_compact_json_with_the_key():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/responses"):
            return httpx.Response(200, json={"output": [_text("hi")], "usage": {}})
        return httpx.Response(404)

    async def main():
        ctx = Agent(_Scripted([]), [], instructions="").runtime.context()
        client = ResponsesHTTPClient("http://model.test/v1/", api_key="sk-1", transport=httpx.MockTransport(handler))
        try:
            response = await client.create({"input": "hi", "b": [1, 2]}, ctx)
        finally:
            await client.aclose()
        return response, client.statistics()

    response, stats = run(main)
    assert response["output"][0]["content"][0]["text"] == "hi"
    assert str(seen[0].url) == "http://model.test/v1/responses"
    assert seen[0].headers["authorization"] == "Bearer sk-1"
    assert seen[0].content == b'{"input":"hi","b":[1,2]}'
    assert stats.num_requests == 1 and stats.bytes_sent == len(seen[0].content)


class _Shaper(Plugin):
    """A test plugin on every harness hook the loop calls."""

    name = "shaper"
    layers = (Layer.HARNESS,)
    seen: ClassVar[list[str]] = []

    @hookimpl
    def loopstack_extra_tools(self, ctx):
        @python_tool(is_concurrency_safe=True)
        def added(key: str) -> str:
            "A tool a plugin adds."
            return f"added {key}"

        return [added]

    @hookimpl
    def loopstack_visible_tools(self, tools, ctx):
        tools.hide("secret")

    @hookimpl
    def loopstack_prepare_request(self, request, ctx):
        request["metadata"] = {"shaped": "yes"}

    @hookimpl
    def loopstack_model_middleware(self, runtime):
        def wrap(next_handler):
            async def handler(request, ctx):
                yield {"type": "shaper.before"}  # an extra event: the loop ignores it
                async for event in next_handler(request, ctx):
                    yield event

            return handler

        return wrap

    @hookimpl
    def loopstack_tool_middleware(self, runtime):
        def wrap(next_handler):
            async def handler(call, ctx):
                _Shaper.seen.append(call.name)
                return await next_handler(call, ctx)

            return handler

        return wrap


def test_plugins_shape_tools_request_and_both_chains(catalog, write_stack):
    _Shaper.seen = []
    catalog.add_plugin(_Shaper, source="tests")
    stack = StackLoader(catalog).load(write_stack("s", "[plugins.shaper]\nenabled = true\n"))
    runtime = StackRuntime(stack, catalog)

    @python_tool
    def secret() -> str:
        "Hidden by the plugin."
        return "leaked"

    model = _Scripted([[_call("added", {"key": "k"}, "c1"), _call("secret", {}, "c2")], [_text("ok")]])
    agent = Agent(model, [secret], instructions="x", runtime=runtime)
    result = run(lambda: agent.run("go"))
    assert [t["name"] for t in model.requests[0]["tools"]] == ["added"]
    assert model.requests[0]["metadata"] == {"shaped": "yes"}
    assert _Shaper.seen == ["added", "secret"]
    tool_events = [e for e in result.events if isinstance(e, ToolCalled)]
    assert [(e.result_text, e.is_error) for e in tool_events] == [("added k", False), ("unknown tool 'secret'", True)]
    assert result.final_text == "ok"
    runtime.close()
