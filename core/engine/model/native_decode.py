"""The decode step's layer loop in C++ (``csrc/q4q8_decode.cpp``, ``csrc/decode_layers.cpp``), built on first use.

A decode step of SmolLM2-135M runs ~35 ATen ops in each of 30 layers; from Python each
costs ~4-8 us of interpreter and binding overhead on top of its kernel, a third of the
step on 2 cores. The extension runs the layers from C++ instead (what CUDA graphs do for a
GPU engine, without capturing anything). It covers what CPU decode runs: a float32 residual stream with weight-only int4
projections (``quant.quantize_model(model, "int4")``), one new token per sequence, up to
``Q4Q8_DENSE_ABOVE_ROWS`` sequences on the q4q8 kernel (``DENSE_ABOVE_ROWS`` on torch's), and speculative
verifications (a few new tokens per sequence after its cached context, up to ``MAX_VERIFY_ROWS``
rows). Anything else (prefill, other quantizations, sliding windows, a GPU, architectures other
than ``NATIVE_ARCHITECTURES``: Qwen3's and Gemma 3's q/k norms) takes the Python layers.

Each query row attends alone over exactly its own context (one attention call per row), so a
row's result does not depend on what else is in the batch: a draft position verified here gets
bit for bit the logits the plain decode step would have given it, and greedy speculative
decoding reproduces plain greedy decoding exactly.

Two loops, one per :class:`~loopstack.engine.model.quant.Int4Linear` format: with q4q8
projections (CPUs with AVX-512 VNNI or AVX2), ``q4q8_decode.cpp`` runs the whole layer as plain loops
over preallocated buffers (no ATen op between the matmuls; its float operations differ from the
Python layers' in order, so logits agree to rounding, not to the bit); with torch's int4pack,
``decode_layers.cpp`` calls the same ATen ops as the Python layers, in the same order.

The build is :mod:`~loopstack.engine.model.extension`'s. ``LOOPSTACK_NATIVE_DECODE=0`` turns it off.
"""

from __future__ import annotations

from typing import Any

import torch

from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.extension import load_extension

__all__ = ["NATIVE_ARCHITECTURES", "NativeDecoder", "load_extension"]

TENSORS_PER_LAYER = 13
# a verification runs here (int4 for every row, as the decode steps it stands for) up to this many
# rows, and drafts of up to MAX_VERIFY_QUERY - 1 tokens
MAX_VERIFY_ROWS = 64
MAX_VERIFY_QUERY = 65
NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2")


class NativeDecoder:
    """Runs a quantized CausalLM's decoder layers for decode steps through the extension."""

    def __init__(self, extension: Any, model: Any, weights: list[torch.Tensor], group_size: int, max_rows: int,
                 is_q4q8: bool = False) -> None:
        self._ext = extension
        self.is_q4q8 = is_q4q8
        self._weights = weights
        c = model.config
        self._shape = (c.num_heads, c.num_kv_heads, c.head_dim)
        self._scale = c.head_dim**-0.5
        self._group_size = group_size
        self.max_rows = max_rows

    @classmethod
    def for_model(cls, model: Any) -> NativeDecoder | None:
        """A decoder for ``model``, or ``None`` where it does not apply or cannot be built."""
        from loopstack.engine.model.quant import DENSE_ABOVE_ROWS, Q4Q8_DENSE_ABOVE_ROWS, Int4Linear

        c = model.config
        if model.device.type != "cpu" or model.dtype != torch.float32 or c.sliding_window is not None:
            return None
        # the C++ loop runs the Llama layer body: no q/k norms, one RoPE, SwiGLU (not Gemma 3, Qwen3)
        if c.architecture not in NATIVE_ARCHITECTURES or c.qk_norm or c.hidden_act != "silu":
            return None
        if c.attention_scale != c.head_dim**-0.5 or not c.has_uniform_layers:
            return None
        layers = list(model.layers)
        projections = [
            p for layer in layers
            for p in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        if not all(isinstance(p, Int4Linear) for p in projections):
            return None
        kernels = {p.kernel for p in projections}
        if len(kernels) != 1:
            return None
        is_q4q8 = kernels == {"q4q8"}
        # int4pack projections are fed bfloat16 (quant.quantize_model sets it), q4q8 ones float32
        if any(layer.projection_dtype != (None if is_q4q8 else torch.bfloat16) for layer in layers):
            return None
        group_sizes = {p.group_size for p in projections}
        unbiased = (p for layer in layers for p in (layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
        if len(group_sizes) != 1 or any(p.bias is not None for p in unbiased):  # only q/k/v may have a bias
            return None
        extension = load_extension()
        if extension is None:
            return None
        empty = torch.empty(0)
        weights: list[torch.Tensor] = []
        for layer in layers:
            attn, mlp = layer.attn, layer.mlp
            weights += [*layer.input_norm.scaled_weight(), attn.qkv_proj.packed, attn.qkv_proj.scales_and_zeros,
                        empty if attn.qkv_proj.bias is None else attn.qkv_proj.bias,
                        attn.o_proj.packed, attn.o_proj.scales_and_zeros, *layer.post_attn_norm.scaled_weight(),
                        mlp.gate_up_proj.packed, mlp.gate_up_proj.scales_and_zeros,
                        mlp.down_proj.packed, mlp.down_proj.scales_and_zeros]
        max_rows = Q4Q8_DENSE_ABOVE_ROWS if is_q4q8 else DENSE_ABOVE_ROWS
        return cls(extension, model, weights, group_sizes.pop(), max_rows, is_q4q8)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # it holds the original model's weights: a copied model takes the Python layers

    def applies(self, meta: AttentionMetadata) -> bool:
        """A decode step of at most ``max_rows`` sequences, or a speculative verification (a few new
        tokens per sequence after its cached context, up to ``MAX_VERIFY_ROWS`` in all)."""
        if meta.max_query_len == 1:
            return meta.num_tokens <= self.max_rows
        return (meta.num_tokens <= MAX_VERIFY_ROWS and meta.max_query_len <= MAX_VERIFY_QUERY
                and all(c > q for q, c in zip(meta.query_lens, meta.context_lens)))

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_slots: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after every decoder layer (``[B, hidden]``); writes the new K/V."""
        num_heads, num_kv_heads, head_dim = self._shape
        contiguous = meta.contiguous_first_block
        row_context_lens = [c - q + 1 + j for q, c in zip(meta.query_lens, meta.context_lens) for j in range(q)]
        contiguous_start = -1 if contiguous is None else contiguous * meta.block_size
        if self.is_q4q8:
            return self._ext.decode_layers_q4q8(
                hidden, cos, sin, kv_slots, meta.slot_mapping, meta.block_tables, row_context_lens, contiguous_start,
                self._weights, num_heads, num_kv_heads, head_dim, meta.block_size, self._scale, list(meta.query_lens),
            )
        return self._ext.decode_layers(
            hidden, cos, sin, kv_slots, meta.slot_mapping, meta.block_tables, row_context_lens, contiguous_start,
            self._weights, num_heads, num_kv_heads, head_dim, meta.block_size, self._group_size, self._scale,
            list(meta.query_lens),
        )
