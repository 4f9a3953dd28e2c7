"""Constrained decoding with xgrammar token bitmasks.

A request's ``grammar`` is one of::

    {"type": "json_schema", "schema": {...}}          # output is JSON valid for the schema
    {"type": "structural_tag", "format": {...}}        # xgrammar structural tag (e.g. free text,
                                                       #   or a <tool_call> block whose JSON follows a schema)
    {"type": "regex", "pattern": "..."}
    {"type": "ebnf", "grammar": "root ::= ..."}

The compiler is built once per tokenizer and caches compiled grammars, so the 2nd
request with the same tool schemas pays nothing. Each sequence gets its own matcher;
the engine fills a bitmask row per constrained sequence before sampling and feeds
every sampled token back with :meth:`GrammarState.accept`.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

import torch

from loopstack.engine.errors import EngineError
from loopstack.engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["GrammarBackend", "GrammarState", "InvalidGrammarError", "apply_bitmask"]

GRAMMAR_TYPES = ("json_schema", "structural_tag", "regex", "ebnf")


class InvalidGrammarError(EngineError, ValueError):
    """The grammar spec is malformed or does not compile (e.g. an invalid JSON Schema)."""


def _vocab_type(tokenizer: Tokenizer) -> xgr.VocabType:
    import xgrammar as xgr

    decoder = tokenizer.backend.decoder
    if decoder is not None and type(decoder).__name__ == "ByteLevel":
        return xgr.VocabType.BYTE_LEVEL
    if "<0x0A>" in tokenizer.backend.get_vocab():
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


class GrammarBackend:
    """Compiles grammar specs for one tokenizer and hands out per-sequence matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # imported here: xgrammar pulls in transformers (~1.5 s), paid only when a grammar is used
        import xgrammar as xgr

        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        encoded = [""] * max(vocab_size, len(vocab))
        for token, index in vocab.items():
            if index < len(encoded):
                encoded[index] = token
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo(
            encoded, _vocab_type(tokenizer), vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2)
        self._lock = threading.Lock()

    def compile(self, spec: dict[str, Any]) -> xgr.CompiledGrammar:
        """Compile ``spec`` (cached). Raises InvalidGrammarError with the reason."""
        if not isinstance(spec, dict) or spec.get("type") not in GRAMMAR_TYPES:
            raise InvalidGrammarError(f"grammar.type must be one of {', '.join(GRAMMAR_TYPES)}")
        kind = spec["type"]
        try:
            with self._lock:
                if kind == "json_schema":
                    schema = spec.get("schema")
                    if not isinstance(schema, dict):
                        raise InvalidGrammarError("grammar.schema must be a JSON Schema object")
                    return self._compiler.compile_json_schema(
                        json.dumps(schema), any_whitespace=False, strict_mode=bool(spec.get("strict", True))
                    )
                if kind == "structural_tag":
                    tag = {"type": "structural_tag", "format": spec.get("format")}
                    return self._compiler.compile_structural_tag(json.dumps(tag))
                if kind == "regex":
                    return self._compiler.compile_regex(str(spec.get("pattern", "")))
                return self._compiler.compile_grammar(str(spec.get("grammar", "")))
        except InvalidGrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the reason
            raise InvalidGrammarError(f"grammar ({kind}) does not compile: {exc}") from None

    def new_state(self, spec: dict[str, Any]) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int | None = None) -> None:
    """Set the tokens ``bitmask`` disallows (and any past ``vocab_size``) in ``logits`` [V] to -inf, in place."""
    import xgrammar as xgr

    vocab_size = min(vocab_size or logits.shape[-1], bitmask.shape[-1] * 32, logits.shape[-1])
    xgr.apply_token_bitmask_inplace(logits[:vocab_size].unsqueeze(0), bitmask)
    if logits.shape[-1] > vocab_size:
        logits[vocab_size:] = float("-inf")


class GrammarState:
    """The matcher of one sequence."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def mask_logits(self, logits: torch.Tensor) -> None:
        """Set disallowed tokens of ``logits`` [V] (CPU, float32) to -inf, in place."""
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        apply_bitmask(logits, self._bitmask, self.vocab_size)

    def next_token_bitmask(self) -> torch.Tensor:
        """A copy of the allowed-token bitmask at the current state (``[1, ceil(V / 32)]`` int32)."""
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.clone()

    @staticmethod
    def allows(bitmask: torch.Tensor, token_id: int) -> bool:
        """Whether ``bitmask`` (from :meth:`next_token_bitmask`) allows ``token_id``."""
        word = int(bitmask[0, token_id // 32])
        return bool((word >> (token_id % 32)) & 1)

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())
