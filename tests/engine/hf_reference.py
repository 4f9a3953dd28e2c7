"""Tiny random-weight Hugging Face models (transformers' own code) as references for the engine's
decoders: build one, save it as a safetensors directory, compare logits."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def randomize(model: torch.nn.Module, *, seed: int = 0, norm_mean: float = 1.0, std: float = 0.2) -> Any:
    """Weights large enough that logits differ by O(1), norms spread around ``norm_mean``
    (1 for Llama-style norms, 0 for Gemma's ``1 + weight``) so that a skipped one shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(norm_mean - 0.5, norm_mean + 0.5)
            else:
                param.normal_(0.0, std)
    return model.eval()


def save_hf_model(model: Any, directory: Path, class_name: str) -> Path:
    """``config.json`` + ``model.safetensors`` (tied heads left out, as HF saves them)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["architectures"] = [class_name]
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return directory


def saved_with_byte_tokenizer(model: Any, directory: Path, class_name: str) -> Path:
    """:func:`save_hf_model` plus the tests' byte-level ``tokenizer.json``: a directory the loader takes."""
    from tests.engine.support import byte_tokenizer

    save_hf_model(model, directory, class_name)
    (directory / "tokenizer.json").write_text(byte_tokenizer().backend.to_str(), encoding="utf-8")
    return directory


def gguf_writer(path: Path, arch: str, config: Any) -> Any:
    """A ``GGUFWriter`` for ``arch`` with the hyperparameters every decoder's file carries
    (layers, sizes, heads, RoPE base, norm epsilon) from a ``ModelConfig``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    return writer


def write_gguf_tensors(writer: Any, state: dict[str, torch.Tensor], layer_names: dict[str, str],
                       transform: Any = None) -> None:
    """Add ``state`` (HF names) to a ``gguf.GGUFWriter`` under llama.cpp's tensor names, then write
    the file. ``layer_names``: HF module -> GGUF block tensor; ``transform(gguf_name, module, tensor)``
    returns the tensor as the converter stores it (permuted Q/K, Gemma's ``1 + weight`` norms)."""
    for name, tensor in state.items():
        module = ""
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, param = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{layer_names[module]}.{param}"
        if transform is not None:
            tensor = transform(gguf_name, module, tensor)
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """``[S, vocab]`` float32 logits of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float()
