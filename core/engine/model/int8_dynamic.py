"""fbgemm's dynamic int8 matmul: int8 weights, activations quantized to 8 bits per call.

``torch.ops.quantized.linear_dynamic`` quantizes each call's float32 input to unsigned
8-bit (one scale and zero for the whole input), multiplies it with per-output-channel int8
weights in int32 (VNNI ``vpdpbusd`` where the CPU has it) and returns float32. On 2 Xeon
cores (AVX-512 VNNI, AMX) it is the fastest weight-only kernel torch ships for
SmolLM2-sized matrices: per decoder layer 255 us against 337 us for the int4 kernel at one
row, 440 against 1,133 us at eight; the 49152 x 576 output head 1.3 ms against 3.5 ms for
``_weight_int8pack_mm`` (one thread, CPU time per call; see docs/engine.md).

The quantized-tensor API it is built on is deprecated in torch (a warning at packing
time); :func:`available` says whether this torch still has it, and callers fall back to
the other kernels when it does not.
"""

from __future__ import annotations

import functools
import warnings

import torch

from loopstack.engine.device import cpu_has_int8_dot

__all__ = ["available", "matmul", "pack"]


@functools.cache
def available() -> bool:
    """Whether this torch build has fbgemm's dynamic int8 linear (x86 builds do)."""
    engines = set(torch.backends.quantized.supported_engines)
    ops = torch.ops.quantized
    return bool(engines & {"fbgemm", "x86"}) and hasattr(ops, "linear_prepack") and hasattr(ops, "linear_dynamic")


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.ScriptObject:
    """Per-output-channel symmetric int8 codes of ``weight [N, K]``, packed for :func:`matmul`."""
    w = weight.detach().float()
    scales = (w.abs().amax(-1) / 127).clamp(min=1e-8).double()  # [N]
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # "quantized tensor creation functions ... are deprecated": the packed form is what we keep
        warnings.simplefilter("ignore", UserWarning)
        codes = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(codes, None if bias is None else bias.detach().float())


def matmul(rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """``[M, N]`` float32 product of float32 ``rows [M, K]`` with the packed weights."""
    # without an int8 dot instruction the u8 x s8 products saturate at 16 bits: use 7-bit activations
    return torch.ops.quantized.linear_dynamic(rows, packed, _REDUCE_RANGE)


_REDUCE_RANGE = not cpu_has_int8_dot()
