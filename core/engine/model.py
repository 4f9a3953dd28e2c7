"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) running over a paged KV cache.

One RoPE convention: the Hugging Face "rotate_half" layout (the two halves of each head
are the real and imaginary parts). Loaders convert other layouts (GGUF's interleaved Q/K)
before the weights reach this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from loopstack.engine.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    build_attention_mask,
    paged_attention,
)
from loopstack.engine.config import ModelConfig

__all__ = ["CausalLM", "rope_inv_freq"]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """``[head_dim / 2]`` float32 rotary frequencies, with "linear" or "llama3" scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one call (normalizes in float32 for low-precision inputs); HF's separate ops cost
        # ~8 dispatches per norm, 60 norms per decode step
        return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        num_tokens, half = x.shape[0], self.head_dim // 2
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, H + 2 Hkv, D]
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        # rotary on q and k at once: rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]
        qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache, meta, mask, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # SwiGLU
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, kv_cache, meta, mask)
        return x + self.mlp(self.post_attn_norm(x))


class CausalLM(nn.Module):
    """Decoder-only transformer: GQA, RoPE, RMSNorm, SwiGLU, optional QKV bias, tied embeddings.

    Q/K/V and gate/up projections are fused (``qkv_proj``, ``gate_up_proj``); the loaders
    take Hugging Face tensor names (:meth:`load_hf_weights`) and fuse them.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # None: tied, the output projection reuses embed_tokens.weight
        self.lm_head: nn.Module | None = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        self.inv_freq = rope_inv_freq(config)  # [D / 2] float32

    @classmethod
    def empty(cls, config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
        """A model with uninitialized weights on ``device`` (fast; load weights next)."""
        with torch.device("meta"):
            model = cls(config)
        model.inv_freq = rope_inv_freq(config)
        return model.to(dtype).to_empty(device=device).eval()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed cache for this model: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        c = self.config
        return allocate_kv_cache(
            c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
            dtype=dtype or self.dtype, device=self.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
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

        Returns:
            ``[N, vocab_size]`` float32 logits.
        """
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self._rotary(positions, hidden.dtype)  # [T, 1, D], sin sign-folded
        mask = build_attention_mask(meta, self.config.sliding_window, hidden.dtype)
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            hidden = layer(hidden, cos, sin, layer_cache, meta, mask)
        if logits_indices is None:
            logits_indices = meta.last_token_indices()
        hidden = self.norm(hidden[logits_indices])  # [N, hidden]
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        sin = angles.sin()
        sin[..., : sin.shape[-1] // 2].neg_()  # [-sin, sin]: pairs with roll(x, D/2) in Attention
        return angles.cos().to(dtype), sin.to(dtype)

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

        Float models only: after :func:`~loopstack.engine.quant.quantize_model` the
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
        for i, module in enumerate(self.layers):
            layer = cast(DecoderLayer, module)
            p = f"model.layers.{i}."
            qkv = layer.attn.qkv_proj
            for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
                fused = getattr(qkv, kind)
                for j, (start, size) in enumerate(((0, q), (q, kv), (q + kv, kv))):
                    targets[f"{p}self_attn.{'qkv'[j]}_proj.{kind}"] = fused[start : start + size]
            targets[f"{p}self_attn.o_proj.weight"] = layer.attn.o_proj.weight
            targets[f"{p}mlp.gate_proj.weight"] = layer.mlp.gate_up_proj.weight[:inter]
            targets[f"{p}mlp.up_proj.weight"] = layer.mlp.gate_up_proj.weight[inter:]
            targets[f"{p}mlp.down_proj.weight"] = layer.mlp.down_proj.weight
            targets[f"{p}input_layernorm.weight"] = layer.input_norm.weight
            targets[f"{p}post_attention_layernorm.weight"] = layer.post_attn_norm.weight
        return targets

