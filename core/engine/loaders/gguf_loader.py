"""Load a Llama-family or Gemma 3 model from a GGUF file (dequantized to float with the ``gguf`` package)."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from loopstack.engine.config import (
    FULL_ATTENTION,
    GEMMA3_LOCAL_ROPE_THETA,
    GEMMA3_SLIDING_WINDOW_PATTERN,
    SLIDING_ATTENTION,
    ModelConfig,
)
from loopstack.engine.errors import UnsupportedArchitectureError
from loopstack.engine.model.architectures import model_class
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.text.tokenizer import Tokenizer, gguf_eos_token_ids

__all__ = [
    "GGUF_ARCHITECTURES", "GGUFTensor", "gguf_config", "load_gguf", "permute_rotary", "read_gguf",
    "unpermute_rotary",
]

# GGUF general.architecture values this loader reads; Mistral GGUFs declare "llama"
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's four norms per layer
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's converter stores Gemma's norm weights as HF weight + 1 (the scale itself)
_NORM_OFFSETS = {"gemma3": 1.0}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def permute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF "rotate_half" Q/K rows -> GGUF's interleaved rotary rows (what llama.cpp's converter does).

    Within each head, rows ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` become ``[x_0, y_0, x_1, y_1, ...]``.
    Works on weights ``[num_heads * head_dim, in]`` and biases ``[num_heads * head_dim]``.
    """
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_rotary`: GGUF interleaved Q/K rows -> HF "rotate_half" rows."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its quantization type, numpy-order shape and raw bytes."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: [out, in] (GGUF lists dimensions innermost first)
    data: np.ndarray  # [rows, bytes per row] uint8, a view of the memory map

    def dequantize(self) -> np.ndarray:
        """The tensor as a writable float32 array of ``shape``."""
        array = gguf.quants.dequantize(self.data, self.qtype).astype(np.float32, copy=False).reshape(self.shape)
        return array if array.flags.writeable else array.copy()  # F32 comes back as a view of the map


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Read a GGUF file's metadata and tensor table (tensor data stays memory-mapped).

    ``gguf.GGUFReader`` builds numpy views for every string of the vocabulary (seconds for a
    49k-token vocabulary); this reads the same header with ``struct`` in a fraction of that.

    Raises:
        ValueError: not a little-endian GGUF file of version 2 or 3.
    """
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    buf = mapped.data  # a memoryview of the map: struct reads it without copying
    magic, version, num_tensors, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    offset = 24

    def read_value(kind: int) -> Any:
        nonlocal offset
        if kind == _STRING:
            (length,) = struct.unpack_from("<Q", buf, offset)
            offset += 8 + length
            return bytes(buf[offset - length : offset]).decode("utf-8")
        if kind == _ARRAY:
            item_kind, count = struct.unpack_from("<IQ", buf, offset)
            offset += 12
            if item_kind in _SCALARS:  # numeric arrays in one go
                dtype = np.dtype(_SCALARS[item_kind])
                offset += dtype.itemsize * count
                return np.frombuffer(mapped, dtype, count, offset - dtype.itemsize * count).tolist()
            return [read_value(item_kind) for _ in range(count)]
        (value,) = struct.unpack_from(_SCALARS[kind], buf, offset)
        offset += struct.calcsize(_SCALARS[kind])
        return value

    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = read_value(_STRING)
        (kind,) = struct.unpack_from("<I", buf, offset)
        offset += 4
        metadata[key] = read_value(kind)
    infos = []
    for _ in range(num_tensors):
        name = read_value(_STRING)
        (num_dims,) = struct.unpack_from("<I", buf, offset)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, offset + 4)
        qtype, data_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * num_dims)
        offset += 4 + 8 * num_dims + 12
        infos.append((name, tuple(int(d) for d in dims), gguf.GGMLQuantizationType(qtype), data_offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-offset // alignment) * alignment
    tensors = {}
    for name, dims, qtype, data_offset in infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block_size * type_size
        num_rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + data_offset
        data = mapped[start : start + row_bytes * num_rows].reshape(num_rows, row_bytes)
        tensors[name] = GGUFTensor(name, qtype, tuple(reversed(dims)), data)
    return metadata, tensors


def gguf_config(metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata.

    Raises:
        UnsupportedArchitectureError: ``general.architecture`` is not one of
            :data:`GGUF_ARCHITECTURES`, or the file uses RoPE scaling this loader does not read.
    """
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    scaling = key("rope.scaling.type", "none")
    rope_scaling: dict[str, Any] | None = None
    if scaling == "linear" and key("rope.scaling.factor") is not None:
        rope_scaling = {"rope_type": "linear", "factor": _float32(key("rope.scaling.factor"))}
    elif scaling not in ("none", None) and "rope_freqs.weight" not in tensor_names:
        raise UnsupportedArchitectureError(f"{arch}: GGUF rope scaling {scaling!r} is not supported")
    hidden_size, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=str(arch),
        vocab_size=int(key("vocab_size") or len(metadata["tokenizer.ggml.tokens"])),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv") or num_heads),
        head_dim=int(key("attention.key_length") or key("rope.dimension_count") or hidden_size // num_heads),
        rope_theta=_float32(key("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)),
        rms_norm_eps=_float32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=any(name.endswith("attn_q.bias") for name in tensor_names),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=gguf_eos_token_ids(metadata),
        rope_scaling=rope_scaling,
        **(_gemma3_fields(metadata, num_layers, hidden_size // num_heads) if arch == "gemma3" else {}),
        qk_norm=arch in ("qwen3", "gemma3"),
    )


def _gemma3_fields(metadata: Mapping[str, Any], num_layers: int, hidden_per_head: int) -> dict[str, Any]:
    """Gemma 3's per-layer attention, as llama.cpp reads it: the window from the file, every
    6th layer global, the local layers' RoPE base 10000 (``rope.freq_base_swa`` where written)."""
    pattern = metadata.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # newer converters: one bool per layer, true = sliding
        layer_types = tuple(SLIDING_ATTENTION if is_sliding else FULL_ATTENTION for is_sliding in pattern)
    else:
        layer_types = tuple(SLIDING_ATTENTION if (i + 1) % int(pattern) else FULL_ATTENTION for i in range(num_layers))
    head_dim = int(metadata.get("gemma3.attention.key_length") or hidden_per_head)
    return {
        "sliding_window": int(metadata["gemma3.attention.sliding_window"]),
        "layer_types": layer_types,
        "rope_local_theta": _float32(metadata.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)),
        # GGUF does not store query_pre_attn_scalar; llama.cpp takes hidden / heads for the 62-layer
        # 27B model (168) and head_dim for the others, as their HF configs have it
        "query_pre_attn_scalar": float(hidden_per_head if num_layers == 62 else head_dim),
        "hidden_act": "gelu_pytorch_tanh",
    }


def load_gguf(path: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, Tokenizer, ModelConfig]:
    """Read a GGUF file into a float model, its tokenizer and its config.

    Raises:
        UnsupportedArchitectureError, UnsupportedTokenizerError: see :func:`gguf_config` and
            :meth:`Tokenizer.from_gguf_metadata`.
    """
    metadata, tensors = read_gguf(path)
    config = gguf_config(metadata, set(tensors))
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    model = model_class(config).empty(config, device, dtype)
    model.load_hf_weights(_hf_tensors(tensors, config, device, dtype))
    if "rope_freqs.weight" in tensors:  # Llama 3.1-style scaling, stored as per-frequency divisors
        factors = torch.from_numpy(tensors["rope_freqs.weight"].dequantize()).float()
        model.inv_freq = model.inv_freq.to(factors.device) / factors
    return model, tokenizer, config


def _float32(value: float) -> float:
    # GGUF floats are float32: 1e-5 arrives as 9.99999974e-06; keep the shortest float32 repr
    return float(str(np.float32(value)))


def _hf_tensors(
    tensors: Mapping[str, GGUFTensor], config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    layer_tensors = _GEMMA3_LAYER_TENSORS if config.architecture == "gemma3" else _LAYER_TENSORS
    norm_offset = _NORM_OFFSETS.get(config.architecture, 0.0)
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue
        hf_name = _GLOBAL_TENSORS.get(name) or _hf_layer_name(name, layer_tensors)
        value = torch.from_numpy(tensor.dequantize())
        if config.architecture == "llama" and re.search(r"\.attn_[qk]\.", name):
            # llama.cpp permutes llama Q/K for interleaved rotary; qwen2/qwen3/gemma3 (NEOX rotary) are stored as is
            num_heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            value = unpermute_rotary(value, num_heads)
        if norm_offset and name.endswith("norm.weight"):
            value -= norm_offset  # to the HF convention the model takes
        yield hf_name, value.to(device=device, dtype=dtype)


def _hf_layer_name(name: str, layer_tensors: Mapping[str, str]) -> str:
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in layer_tensors:
        raise UnsupportedArchitectureError(f"unexpected GGUF tensor {name!r}")
    layer, kind, param = match.groups()
    return f"model.layers.{layer}.{layer_tensors[kind]}.{param}"
