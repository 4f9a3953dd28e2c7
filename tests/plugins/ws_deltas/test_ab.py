"""A/B: an experiment splits sessions between ws_deltas on and off; ``loopstack ab report`` shows it.

Client and server share one metrics registry (as a harness embedded next to its server
would). Both arms talk WebSocket to the same server (the off arm through the plain
full-resend client), so the per-call metrics recorded for every arm — bytes the client sent,
tokens the server tokenized — differ only by the technique. A small test plugin puts the
session id in ``prompt_cache_key`` (what prefix pinning does), so the server assigns each
request the arm its client session has.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from loopstack import Layer, Plugin, PluginCatalog, StackLoader, StackRuntime, hookimpl
from loopstack.cli.ab_report import compare_arms
from loopstack.cli.main import main as cli_main
from loopstack.context import Session
from loopstack.harness.agent import Agent
from loopstack.harness.clients.websocket import ResponsesWebSocketClient
from tests.plugins.ws_deltas.support import (
    ScriptedServer,
    get_weather,
    tokenizer,  # noqa: F401  (fixture)
    weather_script,
    write_stack,
)

EXPERIMENT = """
[plugins.session_cache_key]
enabled = true

[experiments.wsd]
plugin = "ws_deltas"
arms = { on = 0.5, off = 0.5 }
unit = "session"
"""


class SessionCacheKey(Plugin):
    name = "session_cache_key"
    layers = (Layer.HARNESS,)
    summary = "test plugin: prompt_cache_key = the session id"

    @hookimpl
    def loopstack_prepare_request(self, request: dict[str, Any], ctx: Any) -> None:
        request["prompt_cache_key"] = ctx.session.id


def _sessions(runtime: StackRuntime, per_arm: int) -> list[Session]:
    chosen: dict[str, list[Session]] = {"on": [], "off": []}
    index = 0
    while min(len(v) for v in chosen.values()) < per_arm:
        session = Session(id=f"ab-session-{index}")
        arm = runtime.context(session=session).arms["wsd"]
        if len(chosen[arm]) < per_arm:
            chosen[arm].append(session)
        index += 1
    return [s for pair in zip(chosen["on"], chosen["off"], strict=True) for s in pair]


def test_ab_report_shows_the_effect_of_ws_deltas_by_arm(tmp_path, tokenizer, capsys):  # noqa: F811
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(SessionCacheKey, source="tests")
    stack = write_stack(tmp_path, extra=EXPERIMENT)
    server = ScriptedServer(stack, tmp_path / "r.sqlite3", tokenizer, catalog=catalog)
    try:
        runtime = StackRuntime(StackLoader(catalog).load(stack), catalog, metrics=server.state.live.metrics)
        turns = 6

        async def run_all() -> None:
            async with ResponsesWebSocketClient(server.url) as client:
                for session in _sessions(runtime, per_arm=3):
                    server.engine.push(*weather_script(turns))
                    agent = Agent(client, [get_weather], instructions="Be brief.", runtime=runtime, session=session,
                                  max_turns=turns, model="m")
                    await agent.run("Weather in six cities?")

        anyio.run(run_all)
        snapshot = server.state.live.metrics.snapshot()
    finally:
        server.stop()
    ratios = {c.metric: c.ratios["on"] for c in compare_arms(snapshot, resamples=200) if c.plugin == "ws_deltas"}
    assert ratios["loopstack_client_request_bytes"][0] < 0.6  # later turns grow off, stay flat on
    assert ratios["loopstack_api_tokens_tokenized"][0] < 0.6
    assert ratios["loopstack_api_ws_bytes_received"][0] < 0.6
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot))
    assert cli_main(["ab", "report", str(path), "--resamples", "200"]) == 0
    report = capsys.readouterr().out
    assert "ws_deltas / loopstack_api_tokens_tokenized (histogram" in report
    assert "ws_deltas / loopstack_client_request_bytes (histogram" in report
