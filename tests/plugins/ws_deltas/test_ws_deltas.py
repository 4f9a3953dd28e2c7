"""ws_deltas end to end: the harness's client, a real API server, a scripted engine (real tokenizer).

Every test runs the real agent loop (or a raw WebSocket client) against ``loopstack serve``
on loopback; only generation is scripted (``ScriptedEngine``, a test double of the API's
``EngineClient``), so the prompts the server builds are compared token for token.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from websockets.sync.client import connect

from loopstack.harness.agent import Agent
from loopstack.harness.clients.http import ResponsesHTTPClient
from tests.plugins.ws_deltas.support import (
    WEATHER_TOOLS,
    ScriptedServer,
    full_render_ids,
    get_weather,
    runtime_of,
    session_transport,
    tokenizer,  # noqa: F401  (fixture)
    weather_script,
    write_stack,
)

INSTRUCTIONS = "You are brief. Use tools."


async def _session(url: str, runtime: Any, turns: int, *, between: Any = None) -> Agent:
    async with ResponsesHTTPClient(url) as client:
        agent = Agent(client, [get_weather], instructions=INSTRUCTIONS, runtime=runtime, max_turns=turns, model="m")
        async for event in agent.stream("Weather in eight cities?"):
            if between is not None and type(event).__name__ == "ToolCalled":
                await between(agent)
    return agent




def _samples(server: ScriptedServer, metric: str) -> list[float]:
    found = [m for m in server.state.live.metrics.snapshot()["metrics"] if m["name"] == metric]
    return [v for series in (found[0]["series"] if found else []) for v in series["samples"]]


def _off_runtime(server: ScriptedServer) -> Any:
    path = server.stack.parent / "off.toml"
    path.write_text('[stack]\nname = "off"\nextends = "baseline"\n')
    return runtime_of(path)


@pytest.fixture
def server(tmp_path, tokenizer):  # noqa: F811
    started = ScriptedServer(write_stack(tmp_path), tmp_path / "responses.sqlite3", tokenizer)
    yield started
    started.stop()


def test_delta_chain_renders_the_same_tokens_as_full_resend(server, tokenizer):  # noqa: F811
    script = weather_script(8)
    server.engine.push(*script)
    agent = anyio.run(_session, server.url, runtime_of(server.stack), 8)
    delta_prompts, server.engine.prompts = server.engine.prompts, []
    server.engine.push(*script)
    anyio.run(_session, server.url, _off_runtime(server), 8)  # plain HTTP, full resend
    assert len(delta_prompts) == 8 and delta_prompts == server.engine.prompts  # every turn, token for token
    assert delta_prompts[-1] == full_render_ids(tokenizer, INSTRUCTIONS, agent.items[:-1], WEATHER_TOOLS)
    stats = session_transport(agent).statistics()
    assert (stats.num_delta, stats.num_full, stats.connection_setups) == (7, 1, 1)
    tokenized = _samples(server, "loopstack_api_tokens_tokenized")[:8]  # the delta session's calls
    assert tokenized[0] >= len(delta_prompts[0]) and max(tokenized[1:]) < 0.3 * len(delta_prompts[-1])


def test_previous_response_not_found_resends_in_full(server, tokenizer):  # noqa: F811
    server.engine.push(*weather_script(4))

    async def delete_last_response(agent: Agent) -> None:
        cursor = session_transport(agent).cursor
        if cursor is not None and not hasattr(agent, "deleted"):
            agent.deleted = cursor.response_id  # type: ignore[attr-defined]
            async with httpx.AsyncClient() as http:
                assert (await http.delete(f"{server.url}/responses/{cursor.response_id}")).status_code == 200

    agent = anyio.run(lambda: _session(server.url, runtime_of(server.stack), 4, between=delete_last_response))
    stats = session_transport(agent).statistics()
    assert stats.num_not_found == 1 and (stats.num_delta, stats.num_full) == (2, 2)  # the resend was full
    assert server.engine.prompts[-1] == full_render_ids(tokenizer, INSTRUCTIONS, agent.items[:-1], WEATHER_TOOLS)


def test_a_changed_non_input_field_sends_the_full_request(server, tokenizer):  # noqa: F811
    server.engine.push(*weather_script(5))
    runtime = runtime_of(server.stack)

    async def change_temperature(agent: Agent) -> None:
        agent.temperature = 0.5 if len(server.engine.prompts) == 2 else agent.temperature

    agent = anyio.run(lambda: _session(server.url, runtime, 5, between=change_temperature))
    stats = session_transport(agent).statistics()
    assert (stats.num_full, stats.num_delta) == (2, 3)  # the first call, and the one after the change
    reasons = [s["labels"]["reason"] for m in runtime.metrics.snapshot()["metrics"]
               if m["name"] == "loopstack_ws_deltas_fallbacks_total" for s in m["series"]]
    assert reasons == ["fields_changed"]


def test_a_connection_dropped_mid_stream_is_resent(server, tokenizer):  # noqa: F811
    texts = iter(weather_script(4))
    calls = []

    def script(prompt_ids: list[int]) -> str:
        calls.append(len(prompt_ids))
        if len(calls) == 3:  # after response.created went out: the handler dies, the socket closes (1011)
            raise ConnectionResetError("scripted crash in the middle of a response")
        return next(texts)

    server.engine.script = script
    agent = anyio.run(_session, server.url, runtime_of(server.stack), 4)
    stats = session_transport(agent).statistics()
    assert stats.num_resends == 1 and stats.connection_setups == 2 and len(calls) == 5
    assert (stats.num_delta, stats.num_full) == (3, 1)  # the stored chain survived the connection
    assert server.engine.prompts[-1] == full_render_ids(tokenizer, INSTRUCTIONS, agent.items[:-1], WEATHER_TOOLS)


def test_a_server_restart_keeps_the_chain_from_the_store(server, tokenizer):  # noqa: F811
    server.engine.push(*weather_script(4))

    async def restart(agent: Agent) -> None:
        if len(server.engine.prompts) == 2 and not hasattr(agent, "restarted"):
            agent.restarted = True  # type: ignore[attr-defined]
            await anyio.to_thread.run_sync(server.restart)

    agent = anyio.run(lambda: _session(server.url, runtime_of(server.stack), 4, between=restart))
    stats = session_transport(agent).statistics()
    assert stats.connection_setups == 2 and (stats.num_delta, stats.num_full) == (3, 1)
    chain = server.token_state().cache.statistics()
    assert chain.num_misses >= 1 and chain.num_chains == 2  # rebuilt from SQLite once, then cached again
    assert server.engine.prompts[-1] == full_render_ids(tokenizer, INSTRUCTIONS, agent.items[:-1], WEATHER_TOOLS)


def _ws_call(ws: Any, **fields: Any) -> dict[str, Any]:
    ws.send(json.dumps(fields))
    while True:
        event = json.loads(ws.recv(timeout=30))
        if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return event


def test_previous_response_id_is_isolated_between_tenants(tmp_path, tokenizer):  # noqa: F811
    stack = write_stack(tmp_path, api='api_keys = ["key-a:alice", "key-b:bob"]')
    server = ScriptedServer(stack, tmp_path / "r.sqlite3", tokenizer)
    try:
        with connect(server.ws_url, additional_headers={"authorization": "Bearer key-a"}) as alice:
            first = _ws_call(alice, type="response.create", input="Hi", instructions="Be brief.")
            chained = _ws_call(alice, type="response.append", previous_response_id=first["response"]["id"],
                               input=[{"role": "user", "content": "Again"}])
            assert chained["type"] == "response.completed"  # alice's chain is cached now
        with connect(server.ws_url, additional_headers={"authorization": "Bearer key-b"}) as bob:
            for message in ({"type": "response.append"}, {"type": "response.create", "instructions": "Be brief."}):
                error = _ws_call(bob, **message, previous_response_id=chained["response"]["id"], input="steal")
                assert error["type"] == "error" and error["error"]["code"] == "previous_response_not_found"
        assert len(server.engine.prompts) == 2  # nothing of alice's reached generation for bob
    finally:
        server.stop()


def test_deleting_an_earlier_response_ends_the_cached_chain(server, tokenizer):  # noqa: F811
    server.engine.push("one", "two", "three")
    with connect(server.ws_url) as ws:
        first = _ws_call(ws, type="response.create", input="my secret is 1234", instructions="Be brief.")
        second = _ws_call(ws, type="response.append", previous_response_id=first["response"]["id"],
                          input=[{"role": "user", "content": "ok"}])
        assert second["type"] == "response.completed"  # the chain is cached now
        assert httpx.delete(f"{server.url}/responses/{first['response']['id']}").status_code == 200
        error = _ws_call(ws, type="response.append", previous_response_id=second["response"]["id"],
                         input=[{"role": "user", "content": "again"}])
    # as over HTTP: a chain with a deleted link is gone, its text does not live on in the cache
    assert error["type"] == "error" and error["error"]["code"] == "previous_response_not_found"
    assert not any("my secret is 1234" in tokenizer.decode(p) for p in server.engine.prompts[2:])


def test_store_false_chains_live_on_their_connection(server, tokenizer):  # noqa: F811
    with connect(server.ws_url) as ws:
        first = _ws_call(ws, type="response.create", input="Hi", store=False, instructions="Be brief.")
        second = _ws_call(ws, type="response.append", previous_response_id=first["response"]["id"],
                          input=[{"role": "user", "content": "More"}], store=False)
        assert second["type"] == "response.completed"
        assert server.engine.prompts[-1] == full_render_ids(
            tokenizer, "Be brief.", [{"role": "user", "content": "Hi"}, *first["response"]["output"],
                                     {"role": "user", "content": "More"}], [])
    with connect(server.ws_url) as other:
        error = _ws_call(other, type="response.append", previous_response_id=second["response"]["id"], input=[])
        assert error["type"] == "error" and error["error"]["code"] == "previous_response_not_found"


def test_token_state_memory_is_bounded_with_many_chains(tmp_path, tokenizer):  # noqa: F811
    server = ScriptedServer(write_stack(tmp_path, plugin="max_chains = 4"), tmp_path / "r.sqlite3", tokenizer)
    try:
        with connect(server.ws_url) as ws:
            ids = [_ws_call(ws, type="response.create", input=f"chain {i}")["response"]["id"] for i in range(12)]
            stats = server.token_state().cache.statistics()
            assert (stats.num_chains, stats.num_evictions) == (4, 8)
            assert stats.num_tokens_held < 4 * max(len(p) for p in server.engine.prompts) + 64
            evicted = _ws_call(ws, type="response.append", previous_response_id=ids[0],
                               input=[{"role": "user", "content": "back to the first"}])
        assert evicted["type"] == "response.completed"  # an evicted chain is rebuilt from the store, not an error
        assert server.engine.prompts[-1] == full_render_ids(
            tokenizer, None, [{"role": "user", "content": "chain 0"}, {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": "back to the first"}], [])
    finally:
        server.stop()


def test_a_refused_websocket_falls_back_to_http(tmp_path, tokenizer):  # noqa: F811
    from starlette.routing import WebSocketRoute

    server = ScriptedServer(write_stack(tmp_path), tmp_path / "r.sqlite3", tokenizer)
    try:
        app = server.thread.server.config.app
        app.router.routes[:] = [r for r in app.router.routes if not isinstance(r, WebSocketRoute)]
        server.engine.push(*weather_script(3))
        agent = anyio.run(_session, server.url, runtime_of(server.stack), 3)
        stats = session_transport(agent).statistics()
        assert (stats.num_http, stats.num_delta, stats.num_full, stats.connection_setups) == (3, 0, 0, 0)
        assert agent.items[-1]["content"][0]["text"] == "All sunny."
    finally:
        server.stop()


def test_the_off_arm_sends_nothing_through_the_plugin(server, tokenizer):  # noqa: F811
    server.engine.push(*weather_script(3))
    agent = anyio.run(_session, server.url, _off_runtime(server), 3)
    assert session_transport(agent) is None  # the transport hook never ran: plain HTTP
    assert server.token_state().cache.statistics().num_chains == 0


def test_tools_loaded_by_a_tool_search_stay_callable_along_a_delta_chain(server, tokenizer):  # noqa: F811
    from tests.plugins.ws_deltas.support import call_text

    server.engine.push("Searching.", call_text("Oslo"), call_text("Rome"))
    found = {"type": "tool_search_output", "call_id": "search_1", "output": "1 tool found", "tools": WEATHER_TOOLS}
    with connect(server.ws_url) as ws:
        first = _ws_call(ws, type="response.create", input="Weather in Oslo?", instructions="Be brief.")
        second = _ws_call(ws, type="response.append", previous_response_id=first["response"]["id"], input=[found])
        third = _ws_call(ws, type="response.append", previous_response_id=second["response"]["id"],
                         input=[{"type": "function_call_output", "call_id": "x", "output": "sunny"}])
    for done in (second, third):  # parsed as calls: the loaded tool is known without rendering the history
        assert [i["name"] for i in done["response"]["output"] if i["type"] == "function_call"] == ["get_weather"]
    items = [{"role": "user", "content": "Weather in Oslo?"}, *first["response"]["output"], found,
             *second["response"]["output"], {"type": "function_call_output", "call_id": "x", "output": "sunny"}]
    assert server.engine.prompts[-1] == full_render_ids(tokenizer, "Be brief.", items, [])
    assert server.token_state().cache.statistics().num_hits == 2
