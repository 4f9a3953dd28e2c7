"""The engine's C++ kernels (``csrc/``), compiled with torch's ``cpp_extension`` on first use.

Two kinds of kernel live there: the decode step's layer loops (``q4q8_decode.cpp``,
``decode_layers.cpp``; see :mod:`~loopstack.engine.model.native_decode`) and the integer matmul
of 4- or 8-bit weights and two-digit int8 activations that the int4 projections and the head run
on (``q4q8_matmul.cpp``; see :class:`~loopstack.engine.model.quant.Int4Linear`). They release the
GIL while they run. The build needs a C++ compiler and ninja; it takes about two minutes once and is cached by torch
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). If it fails, the engine logs
why once and keeps torch's kernels and the Python layers. ``LOOPSTACK_NATIVE_DECODE=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["SOURCES", "compile_kernels", "has_q4q8", "load_extension", "q4q8_matmul"]

log = logging.getLogger("loopstack.engine")
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("decode_layers.cpp", "q4q8_decode.cpp", "q4q8_matmul.cpp", "q4q8_amx.cpp",
                                              "q4q8_avx2.cpp", "attend_rows.cpp",
                                              "spin_pool.cpp"))
# bump with any change to csrc/: torch caches builds by name
_NAME = "loopstack_kernels_v73"


def compile_kernels(csrc: Path = _CSRC, name: str = _NAME) -> Any:
    """Build (or take torch's cached build of) the kernels in ``csrc`` as module ``name``; raises
    what the build raises. ``scripts/ab_kernels.py`` builds another commit's ``csrc/`` with it."""
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(csrc / source.name) for source in SOURCES], extra_include_paths=[str(csrc)],
                # -fopenmp: torch's headers' parallel helpers are OpenMP pragmas (the kernels use spin_pool.cpp)
                extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def load_extension() -> Any | None:
    """The compiled extension, or ``None`` (turned off, or the build failed: logged once)."""
    if os.environ.get("LOOPSTACK_NATIVE_DECODE", "1") == "0":
        return None
    try:
        return compile_kernels()
    except Exception as exc:  # a missing compiler or ninja, a failed build: torch's kernels still work
        log.warning("native kernels unavailable (%s: %s); decode uses torch's kernels and the Python layers",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def has_q4q8() -> bool:
    """Whether the q4q8 matmul is here and vectorized (AVX-512 VNNI, or AVX2 without AVX-512)."""
    extension = load_extension()
    return extension is not None and bool(extension.q4q8_is_vectorized())


def q4q8_matmul(rows: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[M, K]`` times weights in :func:`~loopstack.engine.model.quant.pack_q4`'s or
    :func:`~loopstack.engine.model.quant.pack_q8`'s format, the rows quantized per group of 32 to
    two int8 digits; ``[M, N]`` in the rows' dtype."""
    extension = load_extension()
    if extension is None:
        raise RuntimeError("the q4q8 kernel needs the engine's C++ extension, which is unavailable")
    out: torch.Tensor = extension.q4q8_matmul(rows, packed, dm)
    return out
