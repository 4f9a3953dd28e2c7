"""Model hyperparameters, read from a Hugging Face ``config.json`` or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loopstack.engine.errors import UnsupportedArchitectureError

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig"]

# model_type -> the HF class name that config.json lists under "architectures"
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM).

    ``rope_scaling`` keeps the Hugging Face dict (``rope_type`` "linear" or "llama3");
    ``sliding_window`` limits attention to the last N positions (Mistral v0.1).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build a config from the dict of a Hugging Face ``config.json``.

        Raises:
            UnsupportedArchitectureError: the architecture is not Llama, Mistral or Qwen2, or
                it uses a feature this decoder does not implement (MLP bias, other
                activations, unsupported RoPE scaling, per-layer sliding windows).
        """
        architecture = _architecture_of(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(
                f"{architecture}: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')"
            )
        if hf.get("mlp_bias", False):
            raise UnsupportedArchitectureError(f"{architecture}: mlp_bias=true is not supported")
        rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 nests rope settings here
        rope_scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        _check_rope_scaling(architecture, rope_scaling)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(i) for i in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=None if hf.get("bos_token_id") is None else int(hf["bos_token_id"]),
            eos_token_ids=eos_ids,
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            sliding_window=_sliding_window_of(architecture, hf),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict describing this model (inverse of ``from_hf_config``)."""
        hf: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES.get(self.architecture, "LlamaForCausalLM")],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "sliding_window": self.sliding_window,
        }
        if self.architecture != "qwen2":
            hf["attention_bias"] = self.qkv_bias
        return hf


def _architecture_of(hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type")
    class_names = list(hf.get("architectures") or [])
    by_class = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    for name in class_names:
        if name in by_class:
            return by_class[name]
    if model_type in SUPPORTED_ARCHITECTURES and not class_names:
        return str(model_type)
    found = class_names[0] if class_names else model_type
    supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {found!r}; supported: {supported}"
    )


def _check_rope_scaling(architecture: str, rope_scaling: Mapping[str, Any] | None) -> None:
    if not rope_scaling:
        return
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"{architecture}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )


def _sliding_window_of(architecture: str, hf: Mapping[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if architecture == "qwen2":
        # HF: layers with index >= max_window_layers use the window, the others attend fully
        num_layers = int(hf["num_hidden_layers"])
        max_window_layers = int(hf.get("max_window_layers", num_layers))
        if not hf.get("use_sliding_window", False) or max_window_layers >= num_layers:
            return None
        if max_window_layers > 0:
            raise UnsupportedArchitectureError(
                "qwen2: sliding windows on only some layers (0 < max_window_layers < "
                "num_hidden_layers) are not supported"
            )
    return None if window is None else int(window)
