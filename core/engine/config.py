"""Model hyperparameters, read from a Hugging Face ``config.json`` or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loopstack.engine.errors import UnsupportedArchitectureError

__all__ = ["FULL_ATTENTION", "SLIDING_ATTENTION", "SUPPORTED_ARCHITECTURES", "ModelConfig"]

# architecture -> the HF class name that config.json lists under "architectures"
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# architecture -> config.json "model_type", where the two differ
_HF_MODEL_TYPES = {"gemma3": "gemma3_text"}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# hidden_act per architecture (the MLP is gated: act(gate) * up)
_ACTIVATIONS = {"gemma3": ("gelu_pytorch_tanh", "gelu_tanh")}
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # HF's layer_types values
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer global, the rest sliding (HF's default, llama.cpp's)
GEMMA3_LOCAL_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Gemma 3).

    ``rope_scaling`` keeps the Hugging Face dict (``rope_type`` "linear" or "llama3");
    ``sliding_window`` limits attention to the last N positions: on every layer when
    ``layer_types`` is empty (Mistral v0.1), else on the ``"sliding_attention"`` layers only
    (Gemma 3: five local layers to one global). ``rope_local_theta`` is the RoPE base of the
    sliding layers (``rope_scaling`` then applies to the full layers only); ``qk_norm`` an
    RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3);
    ``query_pre_attn_scalar`` sets the softmax scale to its ``-0.5`` power (default
    ``head_dim``); ``hidden_act`` the gate activation of the MLP.
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
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(f"unknown layer_types {sorted(unknown)}; expected {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}")

    def is_sliding_layer(self, layer: int) -> bool:
        """Layer ``layer`` attends only to the last ``sliding_window`` positions."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == SLIDING_ATTENTION

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (``None``: it attends to its whole context)."""
        return self.sliding_window if self.is_sliding_layer(layer) else None

    @property
    def has_uniform_layers(self) -> bool:
        """Every layer attends alike (one window, one RoPE): what the native decode loop runs."""
        return len({self.layer_window(i) for i in range(self.num_layers)}) <= 1 and (
            self.rope_local_theta is None or not any(self.is_sliding_layer(i) for i in range(self.num_layers))
        )

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5``, by default ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build a config from the dict of a Hugging Face ``config.json``.

        Raises:
            UnsupportedArchitectureError: the architecture is not Llama, Mistral or Qwen2, or
                it uses a feature this decoder does not implement (MLP bias, other
                activations, unsupported RoPE scaling, per-layer sliding windows).
        """
        architecture = _architecture_of(hf)
        _check_unsupported_features(architecture, hf)
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        is_gemma = architecture == "gemma3"
        hidden_act = str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu")
        if hidden_act not in _ACTIVATIONS.get(architecture, ("silu",)):
            supported = " or ".join(repr(a) for a in _ACTIVATIONS.get(architecture, ("silu",)))
            raise UnsupportedArchitectureError(
                f"{architecture}: hidden_act={hidden_act!r} is not supported (only {supported})"
            )
        rope, local_rope = _rope_parameters(hf)
        rope_scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        _check_rope_scaling(architecture, rope_scaling)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(i) for i in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_layers = int(hf["num_hidden_layers"])
        rope_local_theta = hf.get("rope_local_base_freq", local_rope.get("rope_theta"))
        query_pre_attn_scalar = hf.get("query_pre_attn_scalar", 256 if is_gemma else None)  # HF Gemma 3 default
        return cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 1e6 if is_gemma else 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", is_gemma)),
            qkv_bias=architecture == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=None if hf.get("bos_token_id") is None else int(hf["bos_token_id"]),
            eos_token_ids=eos_ids,
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            sliding_window=_sliding_window_of(architecture, hf),
            layer_types=_layer_types_of(architecture, hf, num_layers),
            rope_local_theta=(float(rope_local_theta or GEMMA3_LOCAL_ROPE_THETA) if is_gemma else None),
            qk_norm=architecture in ("qwen3", "gemma3"),
            query_pre_attn_scalar=None if query_pre_attn_scalar is None else float(query_pre_attn_scalar),
            hidden_act=hidden_act,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict describing this model (inverse of ``from_hf_config``)."""
        hf: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES.get(self.architecture, "LlamaForCausalLM")],
            "model_type": _HF_MODEL_TYPES.get(self.architecture, self.architecture),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
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
        if self.layer_types:
            hf["layer_types"] = list(self.layer_types)
        if self.rope_local_theta is not None:
            hf["rope_local_base_freq"] = self.rope_local_theta
        if self.query_pre_attn_scalar is not None:
            scalar = self.query_pre_attn_scalar
            hf["query_pre_attn_scalar"] = int(scalar) if scalar.is_integer() else scalar  # HF's field is an int
        if self.architecture == "gemma3":
            hf["hidden_activation"] = self.hidden_act
        return hf


def _architecture_of(hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type")
    class_names = list(hf.get("architectures") or [])
    by_class = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    for name in class_names:
        if name in by_class:
            return by_class[name]
    by_model_type = {_HF_MODEL_TYPES.get(k, k): k for k in SUPPORTED_ARCHITECTURES}
    if model_type in by_model_type and not class_names:
        return by_model_type[str(model_type)]
    found = class_names[0] if class_names else model_type
    supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {found!r}; supported: {supported}"
    )


def _check_unsupported_features(architecture: str, hf: Mapping[str, Any]) -> None:
    if hf.get("mlp_bias", False):
        raise UnsupportedArchitectureError(f"{architecture}: mlp_bias=true is not supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(key):
            raise UnsupportedArchitectureError(f"{architecture}: {key}={hf[key]!r} is not supported")


def _rope_parameters(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The RoPE settings of the full-attention layers and of the sliding ones: transformers >= 5
    nests them under ``rope_parameters``, per layer type where the two differ (Gemma 3)."""
    rope = dict(hf.get("rope_parameters") or {})
    if FULL_ATTENTION in rope or SLIDING_ATTENTION in rope:
        return dict(rope.get(FULL_ATTENTION) or {}), dict(rope.get(SLIDING_ATTENTION) or {})
    return rope, {}


def _layer_types_of(architecture: str, hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    if architecture != "gemma3":
        return ()  # one window for all layers (see _sliding_window_of)
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(str(t) for t in layer_types)
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN)
    return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers))


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
    if architecture in ("qwen2", "qwen3"):
        # HF: layers with index >= max_window_layers use the window, the others attend fully
        num_layers = int(hf["num_hidden_layers"])
        max_window_layers = int(hf.get("max_window_layers", num_layers))
        if not hf.get("use_sliding_window", False) or max_window_layers >= num_layers:
            return None
        if max_window_layers > 0:
            raise UnsupportedArchitectureError(
                f"{architecture}: sliding windows on only some layers (0 < max_window_layers < "
                "num_hidden_layers) are not supported"
            )
    return None if window is None else int(window)
