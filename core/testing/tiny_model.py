"""Tiny random-weight models and a byte-level tokenizer, built in code: engine tests without weights.

``build_tiny_model()`` is a 2-layer Llama (vocab 256, hidden 64) whose norms and biases are
randomized too, so that equivalence tests notice when one is skipped; ``tiny_tokenizer_json()``
is a byte-level BPE with the chat specials SmolLM2 uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from loopstack.engine.config import ModelConfig
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.text.tokenizer import Tokenizer

__all__ = [
    "TINY_CONFIG",
    "TINY_SPECIAL_TOKENS",
    "build_tiny_model",
    "byte_tokenizer",
    "tiny_tokenizer_json",
    "tiny_tokenizer_parts",
]

TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def build_tiny_model(seed: int = 0, **overrides: Any) -> CausalLM:
    """A tiny random model; norms and biases are randomized too so that they matter."""
    torch.manual_seed(seed)
    model = CausalLM(dataclasses.replace(TINY_CONFIG, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model


TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_tokenizer_parts() -> tuple[list[str], list[str]]:
    """Tokens and merges of a byte-level BPE: 256 byte symbols, 3 specials (ids 256-258)
    and "Ġt" (id 259, from the one merge "Ġ t")."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + list(TINY_SPECIAL_TOKENS) + ["Ġt"]
    return tokens, ["Ġ t"]


def tiny_tokenizer_json() -> str:
    """``tokenizer.json`` text of the tiny byte-level tokenizer (vocab 260)."""
    tokens, merges = tiny_tokenizer_parts()
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                          merges=[(a, b) for a, b in (m.split(" ") for m in merges)]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    return backend.to_str()


def byte_tokenizer() -> Tokenizer:
    """One token per byte (ids 0-255, no merges; 255 is EOS): token counts equal ASCII character counts."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[255])
