"""Build an engine from a stack's ``[engine]`` table."""

from __future__ import annotations

import torch

from loopstack.stack.schema import EngineConfig
from loopstack.engine.seams.kv_events import KVEventBus
from loopstack.engine.llm_engine import EngineOptions, LLMEngine
from loopstack.engine.loaders import load_model
from loopstack.engine.model.native_decode import NativeDecoder
from loopstack.engine.model.quant import CALIBRATION_TEXT, calibrate_head, quantize_model

__all__ = ["build_engine", "resolve_quantization"]

CPU_DEFAULT_QUANTIZATION = "int4"
CPU_HEAD_QUANTIZATION = "int8_rescored"


def resolve_quantization(config: EngineConfig, device: torch.device) -> str:
    """``auto`` is weight-only int4 on CPU (decode there is bound by weight bytes) and
    none on GPU; explicit int8/int4 on a GPU is an error (the kernels are CPU ones)."""
    if config.quantization == "auto":
        return CPU_DEFAULT_QUANTIZATION if device.type == "cpu" else "none"
    if config.quantization != "none" and device.type != "cpu":
        raise ValueError(f"engine.quantization = {config.quantization!r} uses CPU kernels; on {device} use 'none'")
    return config.quantization


def build_engine(config: EngineConfig, *, event_bus: KVEventBus | None = None) -> LLMEngine:
    """Load the model and tokenizer named by ``config`` and wrap them in an LLMEngine."""
    if config.threads:
        torch.set_num_threads(config.threads)
    model, tokenizer, _, _ = load_model(config.model, device=config.device, dtype=config.dtype)
    quantization = resolve_quantization(config, model.device)
    if quantization != "none":
        # the float32 head was the largest read of a decode step; rescored int8 keeps its top logits exact
        quantize_model(model, quantization, head=CPU_HEAD_QUANTIZATION)  # type: ignore[arg-type]
        calibrate_head(model, tokenizer.encode(CALIBRATION_TEXT))  # the head's int8 pass: see Int8RescoredHead
    if config.native_decode:
        model.native_decoder = NativeDecoder.for_model(model)
    options = EngineOptions(
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
    )
    engine = LLMEngine(model, tokenizer, options, event_bus=event_bus)
    engine.quantization = quantization
    return engine
