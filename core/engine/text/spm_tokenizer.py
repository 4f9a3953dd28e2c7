"""SentencePiece BPE tokenizers from GGUF metadata (``tokenizer.ggml.model = "llama"``: Gemma, Llama 2).

A GGUF file keeps such a vocabulary as pieces, scores and token types, without merges:
llama.cpp's tokenizer repeatedly joins the adjacent pair whose joined piece is in the
vocabulary with the best score. A ``tokenizers`` BPE does the same when its merges list every
way of splitting each piece into two pieces, ranked by the joined piece's score. Spaces are
``▁`` (U+2581), there is no pre-tokenizer splitting, and characters outside the vocabulary
fall back to their UTF-8 bytes (``<0xXX>`` pieces).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["TokenType", "sentencepiece_backend", "sentencepiece_merges"]

SPACE = "\u2581"


class TokenType:
    """llama.cpp's ``tokenizer.ggml.token_type`` values."""

    NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges that reproduce score-ordered SentencePiece merging over ``tokens``.

    Each normal piece of two or more characters yields a merge ``(left, right)`` for each split
    into two normal pieces; merges are ranked by the joined piece's score (best first), ties by
    the ids of the joined piece, then of ``left``.
    """
    ids = {piece: i for i, piece in enumerate(tokens) if token_types[i] == TokenType.NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left_id, right_id = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left_id is not None and right_id is not None:
                ranked.append((-scores[piece_id], piece_id, left_id, piece[:cut], piece[cut:]))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def sentencepiece_backend(metadata: Mapping[str, Any]) -> BackendTokenizer:
    """A ``tokenizers`` tokenizer for a GGUF SentencePiece vocabulary (ids as in the file).

    Control tokens (``<bos>``, ``<start_of_turn>``) become special added tokens, user-defined
    ones (Gemma's runs of newlines and tabs) plain added tokens, both matched in the raw text.
    ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default: true) prepends ``▁`` to the text.
    """
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    scores: list[float] = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab={piece: i for i, piece in enumerate(tokens)},
        merges=sentencepiece_merges(tokens, scores, token_types),
        unk_token=None if unknown_id is None else tokens[int(unknown_id)],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(bpe)
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if add_space_prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(token_types) if kind == TokenType.CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(token_types) if kind == TokenType.USER_DEFINED])
    return backend
