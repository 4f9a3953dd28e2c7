"""Which q4q8 kernel a CPU gets: a vector one wherever the CPU has AVX-512 VNNI or AVX2, not the
scalar loop (an AVX2-only machine once served every decode step through torch's int4 kernel and
the Python layers, at about a quarter of the speed)."""

from __future__ import annotations

import pytest

from loopstack.engine.device import cpu_flags
from loopstack.engine.model import extension


def test_a_cpu_with_avx2_or_vnni_gets_a_vector_kernel():
    kernels = extension.load_extension()
    if kernels is None:
        pytest.skip("the C++ extension did not build here (see the engine's log)")
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        assert kernels.q4q8_instruction_set().startswith("avx512_vnni")
    elif {"avx2", "fma", "f16c"} <= flags:
        assert kernels.q4q8_instruction_set() == "avx2"
    else:
        pytest.skip(f"this CPU has neither AVX-512 VNNI nor AVX2 + FMA + F16C: {sorted(flags)[:8]}...")
    assert extension.has_q4q8()
