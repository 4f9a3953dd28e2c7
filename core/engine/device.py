"""Device and dtype selection for the embedded engine, and what this CPU can do fast."""

from __future__ import annotations

import torch

__all__ = ["cpu_description", "cpu_flags", "cpu_has_fast_bfloat16", "cpu_has_int8_dot", "resolve_device", "resolve_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn a device spec into a ``torch.device``.

    ``"auto"`` picks ``cuda`` when a CUDA device is visible, else ``cpu``. Any other string
    (``"cpu"``, ``"cuda:1"``, ``"mps"``) is passed to ``torch.device``.

    Raises:
        ValueError: a CUDA device was asked for but none is available.
    """
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Pick the compute dtype.

    ``"auto"`` is ``bfloat16`` on CUDA (``float16`` where bf16 is unsupported) and
    ``float32`` elsewhere. On CPU a bfloat16 model is faster at prefill but not at decode,
    and drifts further from the reference (SmolLM2-135M: mean KL 1.4e-3 against float32);
    the weight-only int4 path of ``quant.py`` is faster at both and closer (KL 3e-4).

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; expected 'auto' or one of {', '.join(sorted(_DTYPES))}"
        ) from None


def cpu_has_fast_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16; Linux only).

    Without it a bfloat16 matmul is emulated and slower than float32.
    """
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_int8_dot() -> bool:
    """Whether this CPU has an int8 dot-product instruction (VNNI or AMX-INT8; Linux only).

    With it, int8 x int8 products accumulate in int32 without the 16-bit saturation of
    older AVX2/AVX-512 paths, so activations can use the full 8-bit range.
    """
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


# the instruction sets the engine's kernels choose between (csrc/), as /proc/cpuinfo names them
_KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16")


def cpu_description() -> str:
    """This CPU's model name and which of the kernels' instruction sets it has, for a benchmark's
    record: ``"AMD EPYC (avx2 fma f16c)"``; ``"unknown"`` where /proc/cpuinfo is not readable."""
    fields = _cpuinfo()
    if not fields:
        return "unknown"
    flags = cpu_flags()
    present = " ".join(f for f in _KERNEL_FLAGS if f in flags) or "none of " + "/".join(_KERNEL_FLAGS)
    return f"{fields.get('model name', 'unknown')} ({present})"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (``avx2``, ``avx512_vnni``, ...);
    empty where it is not readable (not Linux)."""
    return set(_cpuinfo().get("flags", "").split())


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo; empty where it is not readable."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields
