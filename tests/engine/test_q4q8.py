"""The q4q8 kernel (csrc/q4q8_matmul.cpp): 4- and 8-bit weights in 16-row tiles times activations
written as two int8 digits, against float matmuls of the same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from loopstack.engine.model import extension
from loopstack.engine.model.quant import Int8RescoredHead, pack_q4, pack_q8

pytestmark = pytest.mark.skipif(not extension.has_q4q8(), reason="the q4q8 kernel needs AVX-512 VNNI or AVX2, and the extension")


def unpack(packed: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The float weights ``[N, K]`` a packed pair stands for (the layout, written independently)."""
    tiles, groups, nbytes = packed.shape
    if nbytes == 256:  # chunk c, byte 4j + i: input 8c + i (low nibble), 8c + 4 + i (high)
        b = packed.view(tiles, groups, 4, 16, 4)
        codes = torch.stack([b & 0x0F, b >> 4], -2)  # [T, G, c, j, h, i]
        codes = codes.permute(0, 3, 1, 2, 4, 5).reshape(tiles * 16, groups, 32)
    else:  # chunk c, byte 4j + i: input 4c + i
        codes = packed.view(tiles, groups, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(tiles * 16, groups, 32)
    d, m = (dm[..., :16].float(), dm[..., 16:].float())
    d, m = (x.transpose(1, 2).reshape(tiles * 16, groups, 1) for x in (d, m))
    return (codes.float() * d + m).reshape(tiles * 16, groups * 32)


@pytest.mark.parametrize("pack", [pack_q4, pack_q8], ids=["q4", "q8"])
@pytest.mark.parametrize("shape", [(48, 96), (960, 576), (64, 1536)])
def test_matmul_matches_a_float_matmul_of_the_same_weights(pack, shape):
    torch.manual_seed(0)
    weight = torch.randn(*shape) * 0.05
    packed, dm = pack(weight)
    dequantized = unpack(packed, dm)
    step = 2 / 15 if pack is pack_q4 else 1 / 127  # of each group's range: the weights' own rounding
    assert (dequantized - weight).abs().max() <= step * weight.abs().max()
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, shape[1])
        x[:, 7] *= 25  # an outlier channel, as SmolLM2's: two digits keep its groups' precision
        expected = x @ dequantized.T
        actual = extension.q4q8_matmul(x, packed, dm)
        assert actual.dtype == torch.float32 and actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=1e-3 * expected.abs().max().item(), rtol=0)
        # each output row depends on its own input row alone, bit for bit
        assert torch.equal(extension.q4q8_matmul(x[-1:], packed, dm)[0], actual[-1])
    assert extension.q4q8_matmul(x.bfloat16(), packed, dm).dtype == torch.bfloat16


def test_gguf_grids_are_recovered_exactly():
    """A Q4_1 source (codes 0..15 times a float16 d, plus a float16 m) and a Q8_0 one ((-127..127) d)."""
    torch.manual_seed(1)
    n, k = 32, 64
    codes = torch.randint(0, 16, (n, k // 32, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans the grid, as a Q4_1 quantizer leaves it
    d = (torch.rand(n, k // 32, 1) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1) * 0.05).half().float()
    q4_weight = (codes * d + m).view(n, k)
    torch.testing.assert_close(unpack(*pack_q4(q4_weight)), q4_weight, atol=1e-6, rtol=0)
    signed = torch.randint(-127, 128, (n, k // 32, 32)).float()
    signed[..., 0] = 127
    q8_weight = (signed * d).view(n, k)
    assert torch.equal(unpack(*pack_q8(q8_weight)), q8_weight)


def test_shapes_it_cannot_tile_are_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"out_features \(40\) a multiple of 16"):
        pack_q4(torch.randn(40, 64))
    with pytest.raises(ValueError, match=r"in_features \(48\) of 32"):
        pack_q8(torch.randn(32, 48))
    packed, dm = pack_q4(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        extension.q4q8_matmul(torch.randn(2, 96), packed, dm)


def test_the_q8_head_scores_a_row_alike_in_a_plain_step_and_in_a_long_verification():
    """A 24-token draft verifies 25 rows: each row's logits must be the ones a one-row decode step
    computes (greedy speculation relies on it), so the q8 head serves past 16 rows too."""
    torch.manual_seed(2)
    head = Int8RescoredHead(torch.randn(320, 64) * 0.05)
    assert head.q8 is not None
    rows = torch.randn(33, 64)
    together = head(rows)
    for i in (0, 16, 24, 32):
        assert torch.equal(head(rows[i : i + 1])[0], together[i])


@pytest.mark.parametrize("pack", [pack_q4, pack_q8], ids=["q4", "q8"])
def test_the_amx_kernel_gives_the_vnni_kernels_bits(pack):
    """Where the CPU has AMX tiles, inputs of many rows take them (csrc/q4q8_amx.cpp): every output
    must be the VNNI kernel's, bit for bit, at every row count (below, at and past a tile's 16)."""
    kernels = extension.load_extension()
    if not kernels.q4q8_use_amx(True):
        pytest.skip("no AMX tiles on this CPU (or LOOPSTACK_AMX=0): only the VNNI kernel runs")
    torch.manual_seed(3)
    packed, dm = pack(torch.randn(96, 1536) * 0.05)
    try:
        for rows in (1, 7, 8, 12, 16, 17, 29, 40):
            x = torch.randn(rows, 1536)
            x[:, 5] *= 40
            with_tiles = extension.q4q8_matmul(x, packed, dm)
            kernels.q4q8_use_amx(False)
            without = extension.q4q8_matmul(x, packed, dm)
            kernels.q4q8_use_amx(True)
            assert torch.equal(with_tiles, without), rows
    finally:
        kernels.q4q8_use_amx(True)


@pytest.mark.parametrize("pack", [pack_q4, pack_q8], ids=["q4", "q8"])
def test_the_weight_prefetch_changes_no_bit(pack):
    """Prefetching is a hint to the cache: any distance, none included, gives the same outputs."""
    kernels = extension.load_extension()
    torch.manual_seed(3)
    packed, dm = pack(torch.randn(96, 576) * 0.05)
    x = torch.randn(20, 576)  # VNNI rows and AMX blocks where the CPU has them
    before = kernels.q4q8_prefetch(-1)
    try:
        outputs = []
        for distance in (0, 64, 4096, 1 << 20):  # the last one far past the end of the weights
            assert kernels.q4q8_prefetch(distance) >= 0
            outputs.append(extension.q4q8_matmul(x, packed, dm))
        assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    finally:
        kernels.q4q8_prefetch(before)
    assert kernels.q4q8_prefetch(-1) == before


@pytest.mark.parametrize("bits", [4, 8])
def test_the_largest_codes_and_digits_do_not_saturate(bits):
    """Every code at an end of its range and every input digit at +-127: the AVX2 kernel adds its
    byte products in 16 bits (q4q8_avx2.cpp), which must hold a group's sums exactly."""
    torch.manual_seed(3)
    n, k = 64, 576
    if bits == 4:  # codes 0 or 15, d = 1/16, m = 0
        weight = torch.randint(0, 2, (n, k)).float() * 15 / 16
        packed, dm = pack_q4(weight)
    else:  # codes -127 or 127 (stored 1 or 255), d = 1/128
        weight = (torch.randint(0, 2, (n, k)).float() * 2 - 1) * 127 / 128
        packed, dm = pack_q8(weight)
    assert torch.equal(unpack(packed, dm), weight)
    x = (torch.randint(0, 2, (8, k)).float() * 2 - 1) * 127  # each group's high digits +-127, low 0
    expected = x.double() @ weight.double().T
    actual = extension.q4q8_matmul(x, packed, dm).double()
    torch.testing.assert_close(actual, expected, atol=0, rtol=1e-6)
