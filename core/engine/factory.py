"""Build an engine: load a model, quantize it for the device, wrap it in an LLMEngine.

The arguments are the engine's own (a model name, :class:`EngineOptions`, loading choices as
keywords, as :func:`~loopstack.engine.loaders.load_model` and
:class:`~loopstack.engine.seams.replica_pool.ReplicaPool` take them); a stack's ``[engine]``
table is translated into them by its caller (``loopstack.api.server.engine_from_table``).
"""

from __future__ import annotations

import os

import torch

from loopstack.engine.llm_engine import EngineOptions, LLMEngine
from loopstack.engine.loaders import DEFAULT_MODEL, load_model
from loopstack.engine.model.native_decode import NativeDecoder
from loopstack.engine.model.quant import CALIBRATION_TEXT, calibrate_head, quantize_model
from loopstack.engine.seams.kv_events import KVEventBus
from loopstack.engine.step_cost_probe import STEP_COST_CHOICES, apply_step_cost

__all__ = ["QUANTIZATIONS", "build_engine", "resolve_quantization"]

QUANTIZATIONS = ("auto", "none", "int8", "int4")
CPU_DEFAULT_QUANTIZATION = "int4"
CPU_HEAD_QUANTIZATION = "int8_rescored"


def _check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")


def resolve_quantization(quantization: str, device: torch.device) -> str:
    """``auto`` is weight-only int4 on CPU (decode there is bound by weight bytes) and
    none on GPU; explicit int8/int4 on a GPU is an error (the kernels are CPU ones).

    Raises:
        ValueError: an unknown ``quantization``, or int8/int4 off the CPU.
    """
    _check_quantization(quantization)
    if quantization == "auto":
        return CPU_DEFAULT_QUANTIZATION if device.type == "cpu" else "none"
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"engine.quantization = {quantization!r} uses CPU kernels; on {device} use 'none'")
    return quantization


def build_engine(
    model: str | os.PathLike[str] = DEFAULT_MODEL,
    options: EngineOptions | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    quantization: str = "auto",
    num_threads: int | None = None,
    native_decode: bool = True,
    event_bus: KVEventBus | None = None,
    num_layers: int | None = None,
) -> LLMEngine:
    """Load ``model`` and its tokenizer and wrap them in an LLMEngine.

    Args:
        model: a built-in name, a ``.gguf`` file or a Hugging Face directory (see ``load_model``).
        options: KV cache and batching settings (default :class:`EngineOptions`).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, or any torch device string.
        dtype: ``"auto"`` or a dtype name.
        quantization: one of :data:`QUANTIZATIONS` (see :func:`resolve_quantization`).
        num_threads: torch CPU threads for this process; None leaves torch's setting.
        native_decode: run decode steps' layer loop in C++ where it applies (CPU, int4).
        event_bus: receives the engine's KV cache events.
        num_layers: keep only the first ``num_layers`` decoder layers (a layer-truncated
            draft; see :meth:`~loopstack.engine.model.llama.CausalLM.truncate_layers`).

    Raises:
        ModelNotFoundError, UnsupportedArchitectureError: from loading; ValueError: a bad
        ``quantization`` for the device or ``num_layers`` out of range.
    """
    _check_quantization(quantization)  # before seconds of loading
    if options is not None and options.step_cost not in STEP_COST_CHOICES:
        raise ValueError(f"EngineOptions.step_cost: {options.step_cost!r}; allowed: {', '.join(STEP_COST_CHOICES)}")
    if num_threads:
        torch.set_num_threads(num_threads)
    loaded = load_model(model, device=device, dtype=dtype)
    if num_layers is not None:
        loaded.model.truncate_layers(num_layers)
    resolved = resolve_quantization(quantization, loaded.model.device)
    if resolved != "none":
        # the float32 head was the largest read of a decode step; rescored int8 keeps its top logits exact
        quantize_model(loaded.model, resolved, head=CPU_HEAD_QUANTIZATION)  # type: ignore[arg-type]
        calibrate_head(loaded.model, loaded.tokenizer.encode(CALIBRATION_TEXT))  # see Int8RescoredHead
    if native_decode:
        loaded.model.native_decoder = NativeDecoder.for_model(loaded.model)
    engine = LLMEngine(loaded.model, loaded.tokenizer, options, event_bus=event_bus)
    engine.quantization = resolved
    apply_step_cost(engine)
    return engine
