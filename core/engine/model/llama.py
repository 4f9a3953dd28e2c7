"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) running over a paged KV cache.

Layers may differ in how they attend (Gemma 3: sliding-window layers with their own RoPE base
between global ones); :class:`CausalLM` groups them by kind and gives each layer its kind's
rotary tables and mask. Architectures with other layer bodies subclass it
(:mod:`~loopstack.engine.model.gemma3`) and keep its paged-KV plumbing.

One RoPE convention: the Hugging Face "rotate_half" layout (the two halves of each head
are the real and imaginary parts). Loaders convert other layouts (GGUF's interleaved Q/K)
before the weights reach this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from loopstack.engine.capture import LayerCapture
from loopstack.engine.config import ModelConfig
from loopstack.engine.model.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    attention_kernels,
    build_attention_mask,
    contiguous_contexts,
    paged_attention,
)

if TYPE_CHECKING:
    from loopstack.engine.model.native_decode import NativeDecoder

# caches the C++ decode layers read (attend_rows.cpp); another dtype takes the Python layers
NATIVE_KV_DTYPES = (torch.float32, torch.float16)

__all__ = ["CausalLM", "LayerKind", "rope_inv_freq"]


def rope_inv_freq(config: ModelConfig, *, sliding: bool = False) -> torch.Tensor:
    """``[head_dim / 2]`` float32 rotary frequencies, with "linear" or "llama3" scaling applied.

    ``sliding``: those of the sliding-window layers; with ``config.rope_local_theta`` set they
    have that base and no scaling (Gemma 3's local layers).
    """
    dim = config.head_dim
    is_local = sliding and config.rope_local_theta is not None
    theta = config.rope_local_theta if is_local and config.rope_local_theta is not None else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if is_local:
        return inv_freq
    scaling = dict(config.rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self._scaled: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None  # see scaled_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            # normalize in float32, scale in the model dtype (as HF does)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * w == x * (w * sqrt(H)) / hypot(|x|, sqrt(H * eps)): four ops
        # where rms_norm takes ~13, and a decode step runs 61 norms of one row each
        scaled_weight, eps_term = self.scaled_weight()
        return (x * scaled_weight).div_(torch.linalg.vector_norm(x, dim=-1, keepdim=True).hypot_(eps_term))

    def scale(self) -> torch.Tensor:
        """What the normalized input is multiplied by: the weight (Gemma's norms: ``1 + weight``)."""
        return self.weight.detach()

    def scaled_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``scale() * sqrt(H)`` and ``sqrt(H * eps)``, remade when the weight changes."""
        weight, cached = self.weight, self._scaled
        if cached is None or cached[0] is not weight or cached[1] != weight._version:
            size, scale = weight.shape[-1], self.scale()
            eps_term = torch.tensor(math.sqrt(size * self.eps), dtype=scale.dtype, device=weight.device)
            cached = self._scaled = (weight, weight._version, scale * math.sqrt(size), eps_term)
        return cached[2], cached[3]


class HeadNorms(nn.Module):
    """RMSNorm over each query head and each key head (``q_norm``, ``k_norm``: Qwen3, Gemma 3),
    applied to the fused qkv rows before RoPE; the value heads pass."""

    def __init__(self, config: ModelConfig, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.q_norm = norm(config.head_dim, config.rms_norm_eps)
        self.k_norm = norm(config.head_dim, config.rms_norm_eps)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        num_heads, num_qk = self.num_heads, self.num_heads + self.num_kv_heads
        # in place: qkv is the projection's fresh output  # [T, H + 2 Hkv, D]
        qkv[:, :num_heads] = self.q_norm.forward(qkv[:, :num_heads])
        qkv[:, num_heads:num_qk] = self.k_norm.forward(qkv[:, num_heads:num_qk])
        return qkv


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.head_norms = HeadNorms(config, norm) if config.qk_norm else None
        self.scale = config.attention_scale
        self.projection_dtype: torch.dtype | None = None  # see CausalLM.use_projection_dtype

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_slots: torch.Tensor,
        context: torch.Tensor | None,
        meta: AttentionMetadata,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        num_tokens, num_heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj.forward(x).view(num_tokens, -1, self.head_dim)  # [T, H + 2 Hkv, D]
        if self.head_norms is not None:
            qkv = self.head_norms.forward(qkv if qkv.dtype == cos.dtype else qkv.to(cos.dtype))
        # rotary on all heads at once (v's rows of cos/sin are 1/0):
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]
        qkv = torch.addcmul(qkv * cos, qkv.roll(self.head_dim // 2, -1), sin)
        kv = qkv[:, num_heads:].view(num_tokens, 2, self.num_kv_heads, self.head_dim).transpose(0, 1)  # [2, T, Hkv, D]
        out = paged_attention(qkv[:, :num_heads], kv, kv_slots, meta, mask, self.scale, context)  # [T, H, D]
        out = out.reshape(num_tokens, -1)
        return self.o_proj.forward(out if self.projection_dtype is None else out.to(self.projection_dtype))


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, SiLU (SwiGLU) or tanh-approximated GELU (Gemma)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.is_gelu = config.hidden_act != "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward((F.gelu(gate, approximate="tanh") if self.is_gelu else F.silu(gate)) * up)


class LayerKind(NamedTuple):
    """How a group of layers attends: its sliding window and whether it takes the local RoPE base."""

    window: int | None
    is_local_rope: bool


class _LayerInputs(NamedTuple):
    cos: torch.Tensor  # [T, H + 2 Hkv, D]
    sin: torch.Tensor
    mask: torch.Tensor | None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.projection_dtype: torch.dtype | None = None  # see CausalLM.use_projection_dtype

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_slots: torch.Tensor,
        context: torch.Tensor | None,
        meta: AttentionMetadata,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # the residual stream keeps the model dtype; projection outputs add into it by promotion
        dtype = self.projection_dtype
        h = self.input_norm.forward(x)
        x = x + self.attn.forward(h if dtype is None else h.to(dtype), cos, sin, kv_slots, context, meta, mask)
        h = self.post_attn_norm.forward(x)
        return x + self.mlp.forward(h if dtype is None else h.to(dtype))


class CausalLM(nn.Module):
    """Decoder-only transformer: GQA, RoPE, RMSNorm, SwiGLU, optional QKV bias, tied embeddings.

    Q/K/V and gate/up projections are fused (``qkv_proj``, ``gate_up_proj``); the loaders
    take Hugging Face tensor names (:meth:`load_hf_weights`) and fuse them.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self._make_layer(config) for _ in range(config.num_layers))
        self.norm = self._make_norm(config)
        # None: tied, the output projection reuses embed_tokens.weight
        self.lm_head: nn.Module | None = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # plain attributes, not buffers: model.to(bfloat16) must not round the frequencies
        self.inv_freq = rope_inv_freq(config)  # [D / 2] float32
        self.local_inv_freq = rope_inv_freq(config, sliding=True)  # of LayerKind.is_local_rope layers
        self._set_layer_kinds()
        # decode steps' layer loop in C++ where it applies (native_decode.NativeDecoder.for_model)
        self.native_decoder: NativeDecoder | None = None

    @staticmethod
    def _make_layer(config: ModelConfig) -> nn.Module:
        return DecoderLayer(config)

    @staticmethod
    def _make_norm(config: ModelConfig) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _set_layer_kinds(self) -> None:
        c = self.config
        kinds = [
            LayerKind(c.layer_window(i), c.is_sliding_layer(i) and c.rope_local_theta is not None)
            for i in range(c.num_layers)
        ]
        self.layer_kinds = list(dict.fromkeys(kinds))  # distinct, in first-layer order
        self._kind_of_layer = [self.layer_kinds.index(kind) for kind in kinds]

    @classmethod
    def empty(cls, config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
        """A model with uninitialized weights on ``device`` (fast; load weights next)."""
        with torch.device("meta"):
            model = cls(config)
        model.inv_freq = rope_inv_freq(config)
        model.local_inv_freq = rope_inv_freq(config, sliding=True)
        return model.to(dtype).to_empty(device=device).eval()

    def truncate_layers(self, num_layers: int) -> None:
        """Keep only the first ``num_layers`` decoder layers (a layer-truncated draft of this
        model: the final norm and the output projection stay). Call before building a
        :class:`NativeDecoder`, which takes the layers it finds.

        Raises:
            ValueError: ``num_layers`` not in ``[1, config.num_layers]``.
        """
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        self.layers = nn.ModuleList(list(self.layers)[:num_layers])
        self.config = dataclasses.replace(
            self.config, num_layers=num_layers, layer_types=self.config.layer_types[:num_layers]
        )
        self._set_layer_kinds()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: float16 under the C++ decode layers (a float32 model on CPU),
        where attention over a long context is bound by reading K/V from memory (half the bytes:
        0.80-0.85x the decode step at 1,000-4,000 positions, docs/engine.md "A float16 KV
        cache"); else the model's. The engine option ``kv_cache_dtype`` overrides it."""
        if self.native_decoder is not None and self.dtype == torch.float32:
            return torch.float16
        return self.dtype

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed cache for this model: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        c = self.config
        return allocate_kv_cache(
            c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
            dtype=dtype or self.kv_cache_dtype, device=self.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        captures: Sequence[LayerCapture] = (),
    ) -> torch.Tensor:
        """Run the new tokens of a batch of sequences and return logits.

        Args:
            input_ids: ``[T]`` new tokens of every sequence, concatenated in ``meta`` order.
            positions: ``[T]`` position of each token in its sequence.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
                the new tokens' K/V are written at ``meta.slot_mapping``.
            meta: query/context lengths, block tables and slots of the batch.
            logits_indices: ``[N]`` token indices (into ``T``) to compute logits for; default
                the last token of each sequence. ``meta.last_token_indices(k + 1)`` serves
                speculative verification, ``torch.arange(T)`` every position.
            captures: hidden-state rows to copy out on the way, sorted by ``num_layers``
                (each gets its ``hidden`` set).

        Returns:
            ``[N, vocab_size]`` float32 logits.
        """
        if input_ids.device.type == "cuda":
            with attention_kernels():
                return self._forward(input_ids, positions, kv_cache, meta, logits_indices, captures)
        return self._forward(input_ids, positions, kv_cache, meta, logits_indices, captures)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,
        captures: Sequence[LayerCapture],
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)  # [T, hidden]
        kv_slots = kv_cache.flatten(2, 3)  # [L, 2, num_blocks * block_size, Hkv, D]
        native = self.native_decoder
        if native is not None and not captures and kv_cache.dtype in NATIVE_KV_DTYPES and native.applies(meta):
            cos, sin = self._rotary(positions, hidden.dtype, self.inv_freq)  # [T, H + 2 Hkv, D]
            hidden = native.run(hidden, cos, sin, kv_slots, meta)  # every layer, in C++ (no mask: each row alone)
            return self._logits(hidden, meta, logits_indices)
        per_kind = [self._layer_inputs(kind, positions, meta, hidden.dtype) for kind in self.layer_kinds]
        has_unmasked = any(inputs.mask is None for inputs in per_kind)
        contexts = contiguous_contexts(kv_slots, meta) if has_unmasked and meta.num_tokens == 1 else None
        layers = zip(self.layers, kv_slots, (per_kind[k] for k in self._kind_of_layer),
                     contexts if contexts is not None else [None] * len(self.layers))
        if captures:  # prefill only: run up to each capture's layer, copy its rows, go on
            num_done = 0
            for capture in captures:
                for layer, layer_slots, (cos, sin, mask), context in islice(layers, capture.num_layers - num_done):
                    context = context if mask is None else None
                    hidden = layer.forward(hidden, cos, sin, layer_slots, context, meta, mask)
                num_done = capture.num_layers
                capture.hidden = hidden.index_select(0, capture.rows).float()
        for layer, layer_slots, (cos, sin, mask), context in layers:
            # .forward, not __call__, inside the layers: module hooks are not supported there,
            # and skipping them saves ~4 us on each of the ~270 module calls of a decode step
            context = context if mask is None else None  # a windowed layer gathers what its mask covers
            hidden = layer.forward(hidden, cos, sin, layer_slots, context, meta, mask)
        return self._logits(hidden, meta, logits_indices)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` input embeddings of ``[T]`` token ids (the residual stream's start)."""
        return self.embed_tokens(input_ids)

    def _layer_inputs(
        self, kind: LayerKind, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype
    ) -> _LayerInputs:
        cos, sin = self._rotary(positions, dtype, self.local_inv_freq if kind.is_local_rope else self.inv_freq)
        return _LayerInputs(cos, sin, build_attention_mask(meta, kind.window, dtype))

    def _logits(self, hidden: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor | None) -> torch.Tensor:
        if logits_indices is None:
            logits_indices = meta.last_token_indices()
        hidden = self.norm(hidden[logits_indices])  # [N, hidden]
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def _rotary(
        self, positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self.local_inv_freq = self.local_inv_freq.to(positions.device)
            inv_freq = inv_freq.to(positions.device)
        c = self.config
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        # rows per head of the fused qkv: q and k rotate, v passes (cos 1, sin 0);
        # sin is [-sin, sin] to pair with roll(x, D/2) in Attention
        shape = (positions.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        num_rotated = c.num_heads + c.num_kv_heads
        cos = torch.ones(shape, dtype=dtype, device=positions.device)
        sin = torch.zeros(shape, dtype=dtype, device=positions.device)
        cos[:, :num_rotated] = angles.cos()
        sin[:, :num_rotated] = angles.sin()
        sin[:, :num_rotated, : c.head_dim // 2].neg_()
        return cos, sin

    def use_projection_dtype(self, dtype: torch.dtype | None) -> None:
        """Feed the projections ``dtype`` activations (``None``: the model's dtype).

        For projections that compute in another dtype (the weight-only kernels take
        bfloat16): the casts then happen once per norm, not inside every projection, and
        SwiGLU runs between two projections without leaving it. The residual stream, norms
        and attention keep the model's dtype.
        """
        for module in self.layers:
            layer = cast(DecoderLayer, module)
            layer.projection_dtype = layer.attn.projection_dtype = dtype

    # -- weights in Hugging Face names ------------------------------------------------------

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in a Hugging Face checkpoint into this model.

        Raises:
            ValueError: a tensor name is unknown, a shape does not match, or a weight is missing.
        """
        targets = self._hf_targets()
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in tensors:
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                    continue
                if name not in targets:
                    raise ValueError(f"unexpected tensor {name!r} for a {self.config.architecture} model")
                target = targets[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
                target.copy_(tensor)
                loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under Hugging Face names (fused projections split back).

        Float models only: after :func:`~loopstack.engine.model.quant.quantize_model` the
        projections no longer hold a ``weight``.
        """
        return {name: t.detach().clone().contiguous() for name, t in self._hf_targets().items()}

    def _hf_targets(self) -> Mapping[str, torch.Tensor]:
        """HF tensor name -> view into this model's (fused) parameters."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        targets: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm.weight,
        }
        if isinstance(self.lm_head, nn.Linear):
            targets["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = cast(Attention, layer.attn), cast(MLP, layer.mlp)
            qkv = attn.qkv_proj
            for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
                fused = getattr(qkv, kind)
                for j, (start, size) in enumerate(((0, q), (q, kv), (q + kv, kv))):
                    targets[f"{p}self_attn.{'qkv'[j]}_proj.{kind}"] = fused[start : start + size]
            targets[f"{p}self_attn.o_proj.weight"] = attn.o_proj.weight
            targets[f"{p}mlp.gate_proj.weight"] = mlp.gate_up_proj.weight[:inter]
            targets[f"{p}mlp.up_proj.weight"] = mlp.gate_up_proj.weight[inter:]
            targets[f"{p}mlp.down_proj.weight"] = mlp.down_proj.weight
            if attn.head_norms is not None:
                targets[f"{p}self_attn.q_norm.weight"] = attn.head_norms.q_norm.weight
                targets[f"{p}self_attn.k_norm.weight"] = attn.head_norms.k_norm.weight
            for hf_name, norm in self._layer_norms(layer).items():
                targets[f"{p}{hf_name}.weight"] = norm.weight
        return targets

    @staticmethod
    def _layer_norms(layer: nn.Module) -> dict[str, RMSNorm]:
        """A layer's norms under their Hugging Face names (without the ``.weight``)."""
        decoder_layer = cast(DecoderLayer, layer)
        return {"input_layernorm": decoder_layer.input_norm, "post_attention_layernorm": decoder_layer.post_attn_norm}

