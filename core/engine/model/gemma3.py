"""Gemma 3 (text): the paged decoder of :mod:`~loopstack.engine.model.llama` with Gemma's layer body.

What differs from Llama, following Hugging Face's ``Gemma3ForCausalLM``:

- embeddings scaled by ``sqrt(hidden_size)``, rounded to the model dtype first;
- four RMSNorms per layer (around attention and around the MLP), plus per-head ``q_norm`` and
  ``k_norm``, all scaling by ``1 + weight`` and computing in float32;
- a GELU-tanh gated MLP, the softmax scale ``query_pre_attn_scalar ** -0.5``, tied embeddings;
- five sliding-window layers to one global layer, the local ones with their own RoPE base
  (``ModelConfig.layer_types`` / ``rope_local_theta``; :class:`~loopstack.engine.model.llama.CausalLM`
  gives each layer its kind's rotary tables and mask).

Weights use the Hugging Face convention (a norm stores ``weight``, the model scales by
``1 + weight``); the GGUF loader converts llama.cpp's stored ``weight + 1`` on the way in.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from loopstack.engine.config import ModelConfig
from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.llama import MLP, Attention, CausalLM, RMSNorm

__all__ = ["Gemma3CausalLM", "Gemma3DecoderLayer", "GemmaRMSNorm"]


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight``, in float32 whatever the input dtype (as HF's Gemma does);
    returns the input's dtype. The weight initializes to 0 (the identity scale)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return self._normalize(x)
        return self._normalize(x.float()).to(x.dtype)

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.detach().float()


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP; the residual keeps the model dtype."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_norm = GemmaRMSNorm(size, eps)
        self.attn = Attention(config, GemmaRMSNorm)
        self.post_attn_norm = GemmaRMSNorm(size, eps)
        self.pre_mlp_norm = GemmaRMSNorm(size, eps)
        self.mlp = MLP(config)
        self.post_mlp_norm = GemmaRMSNorm(size, eps)
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
        dtype = self.projection_dtype
        h = self.input_norm.forward(x)
        h = self.attn.forward(h if dtype is None else h.to(dtype), cos, sin, kv_slots, context, meta, mask)
        x = x + self.post_attn_norm.forward(h if h.dtype == x.dtype else h.to(x.dtype))
        h = self.pre_mlp_norm.forward(x)
        h = self.mlp.forward(h if dtype is None else h.to(dtype))
        return x + self.post_mlp_norm.forward(h if h.dtype == x.dtype else h.to(x.dtype))


class Gemma3CausalLM(CausalLM):
    """Gemma 3's text decoder over the paged KV cache (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._embed_scale: torch.Tensor | None = None  # sqrt(hidden) in the model dtype, made on first use

    @staticmethod
    def _make_layer(config: ModelConfig) -> nn.Module:
        return Gemma3DecoderLayer(config)

    @staticmethod
    def _make_norm(config: ModelConfig) -> RMSNorm:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        scale = self._embed_scale
        if scale is None or scale.dtype != hidden.dtype or scale.device != hidden.device:
            # HF rounds the scale to the model dtype before multiplying (25.25, not 25.30, in bfloat16)
            scale = self._embed_scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=hidden.dtype,
                                                     device=hidden.device)
        return hidden.mul_(scale)

    @staticmethod
    def _layer_norms(layer: nn.Module) -> dict[str, RMSNorm]:
        layer = cast(Gemma3DecoderLayer, layer)
        return {
            "input_layernorm": layer.input_norm,
            "post_attention_layernorm": layer.post_attn_norm,
            "pre_feedforward_layernorm": layer.pre_mlp_norm,
            "post_feedforward_layernorm": layer.post_mlp_norm,
        }
