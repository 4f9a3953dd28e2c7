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


def hf_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """``[S, vocab]`` float32 logits of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float()
