"""SentencePiece BPE from GGUF metadata: score-ordered merges, byte fallback, ▁ for spaces."""

from __future__ import annotations

from loopstack.engine.text.spm_tokenizer import TokenType, sentencepiece_merges
from loopstack.engine.text.tokenizer import Tokenizer

BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_metadata(pieces: dict[str, float], **extra: object) -> dict[str, object]:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", *BYTES, *pieces]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN, TokenType.CONTROL] + [TokenType.BYTE] * 256
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 261 + list(pieces.values()),
        "tokenizer.ggml.token_type": types + [TokenType.NORMAL] * len(pieces),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_space_prefix": False,
        **extra,
    }


def pieces_of(tokenizer: Tokenizer, text: str) -> list[str | None]:
    return [tokenizer.id_to_token(i) for i in tokenizer.encode(text)]


def test_the_better_scored_pair_merges_first():
    base = {"a": -1.0, "b": -2.0, "c": -3.0, "\u2581": -4.0}
    bc_first = Tokenizer.from_gguf_metadata(spm_metadata({**base, "ab": -20.0, "bc": -10.0}))
    ab_first = Tokenizer.from_gguf_metadata(spm_metadata({**base, "ab": -10.0, "bc": -20.0}))
    assert pieces_of(bc_first, "abc") == ["a", "bc"]
    assert pieces_of(ab_first, "abc") == ["ab", "c"]


def test_merges_list_every_split_ranked_by_the_joined_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [-1.0, -2.0, -3.0, -5.0, -4.0, -6.0]
    merges = sentencepiece_merges(tokens, scores, [TokenType.NORMAL] * 6)
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_spaces_become_the_meta_symbol_and_unknown_characters_fall_back_to_bytes():
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata({"a": -1.0, "\u2581": -2.0, "\u2581a": -3.0}))
    assert pieces_of(tokenizer, "a aé") == ["a", "\u2581a", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(tokenizer.encode("a aé")) == "a aé"
    assert pieces_of(tokenizer, "<start_of_turn>a") == ["<start_of_turn>", "a"]
    assert tokenizer.decode(tokenizer.encode("<start_of_turn>a")) == "a"  # control tokens skipped


def test_llama2_style_space_prefix_is_added_and_stripped():
    metadata = spm_metadata({"a": -1.0, "\u2581": -2.0, "\u2581a": -3.0}, **{"tokenizer.ggml.add_space_prefix": True})
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert pieces_of(tokenizer, "a a") == ["\u2581a", "\u2581a"]
    assert tokenizer.decode(tokenizer.encode("a a")) == "a a"


def test_gemma_files_get_a_chat_template_and_the_turn_end_token_when_they_carry_none():
    metadata = spm_metadata({"a": -1.0})
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], "<end_of_turn>"]  # type: ignore[list-item]
    metadata["tokenizer.ggml.scores"] = [*metadata["tokenizer.ggml.scores"], 0.0]  # type: ignore[list-item]
    metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], TokenType.CONTROL]  # type: ignore[list-item]
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.eos_token_ids == (1, 262)
    assert tokenizer.apply_chat_template([{"role": "user", "content": " a "}, {"role": "assistant", "content": "a"}],
                                         add_generation_prompt=False) == (
        "<bos><start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\na<end_of_turn>\n")
