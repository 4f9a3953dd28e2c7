"""The session socket's connection management: keepalive pings, age rotation, first-event timeout."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from websockets.asyncio.server import serve

from loopstack.harness.agent import Agent
from loopstack.harness.clients.base import ServerEndpoint
from loopstack.harness.clients.http import ResponsesHTTPClient
from loopstack.harness.events import ToolCalled
from loopstack.plugins.ws_deltas.config import WsDeltasConfig
from loopstack.plugins.ws_deltas.transport import DeltaTransport
from tests.plugins.ws_deltas.support import (
    ScriptedServer,
    get_weather,
    runtime_of,
    session_transport,
    tokenizer,  # noqa: F401  (fixture)
    weather_script,
    write_stack,
)


async def _run(server: ScriptedServer, runtime: Any, turns: int, pause_s: float) -> tuple[Agent, Any]:
    async with ResponsesHTTPClient(server.url) as client:
        agent = Agent(client, [get_weather], instructions="Be brief.", runtime=runtime, max_turns=turns, model="m")
        async for event in agent.stream("Weather?"):
            if isinstance(event, ToolCalled):
                await anyio.sleep(pause_s)
        transport = session_transport(agent)  # after the run: the hook made it
        latency = transport.client.latency
    return agent, latency


@pytest.fixture
def scripted(tmp_path, tokenizer):  # noqa: F811
    def start(plugin: str) -> ScriptedServer:
        server = ScriptedServer(write_stack(tmp_path, plugin=plugin), tmp_path / "r.sqlite3", tokenizer)
        servers.append(server)
        return server

    servers: list[ScriptedServer] = []
    yield start
    for server in servers:
        server.stop()


def test_keepalive_pings_keep_an_idle_session_socket_open(scripted):
    server = scripted("ping_interval_s = 0.05")
    server.engine.push(*weather_script(3))
    agent, latency = anyio.run(_run, server, runtime_of(server.stack), 3, 0.3)  # idle 6 ping periods per turn
    stats = session_transport(agent).statistics()
    assert stats.connection_setups == 1 and (stats.num_delta, stats.num_full) == (2, 1)
    assert latency is not None and latency > 0  # a pong came back (websockets measures it per ping)


def test_an_old_connection_is_rotated_between_calls_and_the_chain_continues(scripted):
    server = scripted("max_connection_age_s = 0.01")
    server.engine.push(*weather_script(4))
    agent, _ = anyio.run(_run, server, runtime_of(server.stack), 4, 0.03)
    stats = session_transport(agent).statistics()
    assert stats.connection_setups == 4  # a fresh connection for every call
    assert (stats.num_delta, stats.num_full, stats.num_resends) == (3, 1, 0)  # stored chains span connections


def test_a_first_event_timeout_drops_the_connection_and_resends():
    received: list[dict[str, Any]] = []

    async def handler(ws: Any) -> None:
        async for message in ws:
            received.append(json.loads(message))
            if len(received) > 1:  # the first message is swallowed: no event ever comes for it
                await ws.send(json.dumps({"type": "response.completed",
                                          "response": {"id": "resp_1", "status": "completed", "output": []}}))

    async def never(*args: Any) -> dict[str, Any]:
        raise AssertionError("no HTTP fallback expected")

    async def main() -> Any:
        async with serve(handler, "127.0.0.1", 0) as ws_server:
            port = ws_server.sockets[0].getsockname()[1]
            transport = DeltaTransport(WsDeltasConfig(first_event_timeout_s=0.2))
            ctx = runtime_of_baseline().context()
            with anyio.fail_after(10):
                response = await transport.create({"model": "m", "input": [{"role": "user", "content": "hi"}]}, ctx,
                                                  endpoint=ServerEndpoint(f"http://127.0.0.1:{port}/v1"),
                                                  fallback=never)
            await transport.aclose()
            return response, transport.statistics()

    response, stats = anyio.run(main)
    assert response["id"] == "resp_1" and [m["type"] for m in received] == ["response.create"] * 2
    assert (stats.num_resends, stats.connection_setups, stats.num_full) == (1, 2, 1)


def runtime_of_baseline() -> Any:
    from loopstack import PluginCatalog, StackLoader, StackRuntime

    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    return StackRuntime(StackLoader(catalog).load("baseline"), catalog)
