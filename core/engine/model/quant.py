"""Weight-only int4/int8 linear layers on torch's CPU kernels, for batch-1 decode on CPU.

Decode at batch 1 reads every weight once per token, so its speed is set by weight bytes.
``_weight_int4pack_mm_for_cpu`` (4-bit, group-wise scale and zero) and
``_weight_int8pack_mm`` (8-bit, per-channel scale) read 8x / 4x fewer bytes than float32.
Both want bfloat16 activations (their float32 variants are 10x slower): the layers cast in
and out, so the residual stream, norms and attention keep the model's float32 (a
:class:`~loopstack.engine.model.llama.CausalLM` quantized with bfloat16 dense weights is fed
bfloat16 directly: see ``CausalLM.use_projection_dtype``).

Past ~12 rows these kernels lose to a dense matmul, so each layer keeps float weights
(``dense``) for prefill-sized inputs: bfloat16 where the CPU multiplies it natively
(AMX / AVX512-BF16: ~5x faster than float32 at 1024 rows), else float32.

int4 suits GGUF Q4_1/Q4_0 sources: their weights already sit on a 4-bit grid of 32-wide
groups, which the min/max quantizer here recovers exactly (up to bfloat16 scales). For
bfloat16 checkpoints int8 loses less.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from loopstack.engine.device import cpu_has_fast_bfloat16
from loopstack.engine.model import extension, huge_pages, int8_dynamic
from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.llama import CausalLM

__all__ = [
    "DENSE_ABOVE_ROWS", "MAX_Q8_HEAD_ROWS", "Q4Q8_DENSE_ABOVE_ROWS", "MAX_RESCORED_ROWS", "DynamicInt8Linear", "HeadMode", "Int4Linear", "Int8Linear",
    "Int8RescoredHead", "QuantMode", "CALIBRATION_TEXT", "calibrate_head", "pack_q4", "pack_q8", "quantize_model",
]

QuantMode = Literal["int4", "int8", "int8_dynamic"]
HeadMode = Literal["int4", "int8", "int8_dynamic", "int8_rescored"]
# measured on 2 Xeon cores (AVX-512 + AMX): int4 wins up to ~12 rows, bf16 dense beyond.
# Measure in the whole model: one matrix alone stays in L3 and flatters bf16 dense (at 8 rows
# it looks 1.3x faster than int4; a batch-8 decode step is 1.15x slower with it)
DENSE_ABOVE_ROWS = 8
# the same for the q4q8 kernel (Int4Linear's on VNNI CPUs, and the C++ decode layers): it was 8
# until the kernel had its AMX path; at batch 16 the C++ layers take 21.7-23.1 ms a step against 45.5 on
# bf16 dense layers, 694-737 against 351 tok/s (scripts/profile_decode_step.py --batch 16, 2 Xeon cores)
Q4Q8_DENSE_ABOVE_ROWS = 16
# rows up to which a rescored head ranks with a cheap pass (all-position logits go exact)
MAX_RESCORED_ROWS = 16
# rows up to which the q8 head serves (its rows are independent of how many share the call, so a
# verification of any draft length picks what a plain decode step would; it was 16, and a 17-row
# verification paid the float head's 113 MB read: 52-66 ms a step against 27 at 16 rows)
MAX_Q8_HEAD_ROWS = 256


class _WeightOnlyLinear(nn.Module, ABC):
    """Shared forward: quantized kernel for up to ``dense_above_rows`` rows, else ``dense``."""

    in_features: int
    out_features: int
    dense: torch.Tensor
    bias: torch.Tensor | None
    kernel_dtype: torch.dtype = torch.bfloat16  # what _quantized_mm takes and returns
    dense_above_rows: int = DENSE_ABOVE_ROWS

    def __init__(self, dense: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = dense.shape
        self.register_buffer("dense", dense, persistent=False)  # [N, K] weights for prefill-sized inputs
        self.register_buffer("bias", bias, persistent=False)

    @abstractmethod
    def _quantized_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """``[M, N]`` output of ``[M, K]`` ``rows``, both ``kernel_dtype`` (each subclass's kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step calls this 4x per layer: no-op casts and views are skipped, not called
        is_2d = x.dim() == 2
        rows = x if is_2d else x.reshape(-1, self.in_features)  # [M, K]
        if rows.shape[0] > self.dense_above_rows:
            dense = self.dense
            out = F.linear(rows if rows.dtype == dense.dtype else rows.to(dense.dtype), dense)
        else:
            kernel_dtype = self.kernel_dtype
            out = self._quantized_mm(rows if rows.dtype == kernel_dtype else rows.to(kernel_dtype))  # [M, N]
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if not is_2d:
            out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Int4Linear(_WeightOnlyLinear):
    """4-bit weights in groups of ``group_size`` input columns, each with a scale and an offset.

    Two formats, chosen at construction (``kernel``):

    - ``"q4q8"`` where the engine's C++ extension has its vector matmul, AVX-512 VNNI
      (``csrc/q4q8_matmul.cpp``) or, on CPUs without AVX-512, AVX2 (``csrc/q4q8_avx2.cpp``,
      the same bits): GGUF Q4_1's encoding (code * d + m, float16 d and m, groups
      of 32), times activations quantized per group of 32 to two int8 digits on each call
      (15 bits): integer dot products, as llama.cpp runs Q4_1 on such CPUs. Fed float32. Needs
      out_features to be a multiple of 16.
    - ``"int4pack"`` elsewhere: torch's ``_weight_int4pack_mm_for_cpu``, bfloat16 activations,
      bfloat16 scale and zero; the zero's rounding is the larger error, and each group picks
      the encoding whose zero rounds better (see ``_int4_groups``).
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32,
        dense_dtype: torch.dtype = torch.float32, kernel: Literal["q4q8", "int4pack"] | None = None,
    ) -> None:
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValueError(f"in_features ({in_features}) must be a multiple of group_size ({group_size})")
        super().__init__(weight.detach().to(dense_dtype), None if bias is None else bias.detach())
        self.group_size = group_size
        if kernel is None:
            is_tileable = group_size == 32 and out_features % 16 == 0
            kernel = "q4q8" if is_tileable and extension.has_q4q8() else "int4pack"
        self.kernel = kernel
        if kernel == "q4q8":
            self.kernel_dtype = torch.float32  # it quantizes its input itself
            self.dense_above_rows = Q4Q8_DENSE_ABOVE_ROWS
            packed, scales_and_zeros = pack_q4(weight)  # scales_and_zeros: d and m of each group
        else:
            groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
            codes, scale, zero = _int4_groups(groups)
            codes_int32 = codes.view(out_features, in_features).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_int32, 2)
            scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [G, N, 2]
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)

    def _quantized_mm(self, rows: torch.Tensor) -> torch.Tensor:
        if self.kernel == "q4q8":
            return extension.q4q8_matmul(rows, self.packed, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.contiguous(), self.packed, self.group_size, self.scales_and_zeros
        )


def pack_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` (N a multiple of 16, K of 32) in the q4q8 kernel's 4-bit format: min/max
    codes per group of 32 inputs, ``weight ~ code * d + m`` with float16 ``d`` and ``m`` (for a GGUF
    Q4_1 source, its own codes and scales), 16 rows side by side (``csrc/q4q8_matmul.cpp``
    describes the layout). Returns ``packed`` (uint8 ``[N / 16, K / 32, 256]``) and ``dm``
    (float16 ``[N / 16, K / 32, 32]``: per row tile and group, 16 ``d`` then 16 ``m``)."""
    groups = _groups_of(weight)
    low, high = torch.aminmax(groups, dim=-1)  # [N, G]
    d, m = ((high - low) / 15).to(torch.float16), low.to(torch.float16)
    step = d.float()
    codes = (groups - m.float()[..., None]).div_(torch.where(step == 0, 1.0, step)[..., None]).round_().clamp_(0, 15)
    codes = codes.masked_fill_((step == 0)[..., None], 0).to(torch.uint8)
    tiles, num_groups = weight.shape[0] // 16, groups.shape[1]
    # input 32g + 8c + 4h + i of row 16t + j -> chunk (t, g, c), byte 4j + i, nibble h
    codes = codes.view(tiles, 16, num_groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [T, G, C, j, i, h]
    packed = (codes[..., 0] | (codes[..., 1] << 4)).reshape(tiles, num_groups, 256).contiguous()
    return packed, _tile_scales(d, m)


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in the q4q8 kernel's 8-bit format: symmetric codes per group of 32 inputs
    (``weight ~ (code - 128) * d``, GGUF's Q8_0: for a Q8_0 source its own codes and scales), 16
    rows side by side. Returns ``packed`` (uint8 ``[N / 16, K / 32, 512]``) and ``dm`` as
    :func:`pack_q4`'s (``m = -128 d``)."""
    groups = _groups_of(weight)
    d = (groups.abs().amax(-1) / 127).to(torch.float16)  # [N, G]
    step = d.float()
    codes = groups.div(torch.where(step == 0, 1.0, step)[..., None]).round_().clamp_(-127, 127).add_(128)
    codes = codes.to(torch.uint8)
    tiles, num_groups = weight.shape[0] // 16, groups.shape[1]
    # input 32g + 4c + i of row 16t + j -> chunk (t, g, c), byte 4j + i
    codes = codes.view(tiles, 16, num_groups, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, C, j, i]
    return codes.reshape(tiles, num_groups, 512).contiguous(), _tile_scales(d, d * -128)


def _groups_of(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    if out_features % 16 or in_features % 32:
        raise ValueError(f"the q4q8 kernel needs out_features ({out_features}) a multiple of 16 and "
                         f"in_features ({in_features}) of 32")
    return weight.detach().float().reshape(out_features, in_features // 32, 32)


def _tile_scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    tiles, num_groups = d.shape[0] // 16, d.shape[1]
    per_tile = [x.view(tiles, 16, num_groups).transpose(1, 2) for x in (d, m)]  # [T, G, 16]
    return torch.cat(per_tile, -1).contiguous()


def _int4_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max 4-bit codes ``[N, G, gs]`` with bfloat16 scales and zeros ``[N, G]``.

    The kernel computes ``(code - 8) * scale + zero``. A group has two such encodings:
    ``zero = low + 8 * scale``, or the codes flipped (``15 - code``) with ``-scale`` and
    ``zero = low + 7 * scale``. bfloat16 rounds the two zeros differently; each group keeps
    the encoding whose dequantized weights are closer to the float ones.
    """
    low, high = torch.aminmax(groups, dim=-1)  # [N, G]
    scale = ((high - low) / 15).clamp_(min=1e-8)
    codes = (groups - low[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)  # [N, G, gs]
    scale_bf16 = scale.to(torch.bfloat16)
    zero_bf16, flipped_zero_bf16 = (low + 8 * scale).to(torch.bfloat16), (low + 7 * scale).to(torch.bfloat16)
    plain = (codes - 8) * scale_bf16.float()[..., None] + zero_bf16.float()[..., None]
    flipped = (7 - codes) * -scale_bf16.float()[..., None] + flipped_zero_bf16.float()[..., None]
    is_flipped = (flipped - groups).square_().sum(-1) < (plain - groups).square_().sum(-1)  # [N, G]
    codes = torch.where(is_flipped[..., None], 15 - codes, codes)
    scale_bf16 = torch.where(is_flipped, -scale_bf16, scale_bf16)
    return codes, scale_bf16, torch.where(is_flipped, flipped_zero_bf16, zero_bf16)


class Int8Linear(_WeightOnlyLinear):
    """8-bit weights with one symmetric scale per output channel."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, dense_dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(weight.detach().to(dense_dtype), None if bias is None else bias.detach())
        w = weight.detach().float()
        scale = (w.abs().amax(-1) / 127).clamp(min=1e-8).to(torch.bfloat16)  # [N]
        codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("codes", codes.to(torch.int8), persistent=False)
        self.register_buffer("scales", scale, persistent=False)

    def _quantized_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.codes, self.scales)


class DynamicInt8Linear(_WeightOnlyLinear):
    """8-bit weights (per-channel scale) times activations quantized to 8 bits on each call:
    fbgemm's dynamic int8 linear (:mod:`~loopstack.engine.model.int8_dynamic`), float32 in and out.

    The fastest decode kernel on CPUs with VNNI (1.3x the int4 kernel at one row, 2.6x at
    eight), at the cost of 8-bit activations: one scale per call's input.
    """

    kernel_dtype = torch.float32

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, dense_dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(weight.detach().to(dense_dtype), None if bias is None else bias.detach())
        self.packed = int8_dynamic.pack(weight)  # the bias is added by the shared forward

    def _quantized_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return int8_dynamic.matmul(rows.contiguous(), self.packed)


class Int8RescoredHead(nn.Module):
    """Output head on 8-bit weights. Where the q4q8 kernel is (AVX-512 VNNI or AVX2), its 8-bit format
    (GGUF's Q8_0, groups of 32, times 15-bit activations) is the head: its logits are within ~0.01
    of the float ones (SmolLM2: KL 1e-7), and a SmolLM2 decode step spends 1.4 ms in it against
    2.0 ms for the rescored fbgemm head. Elsewhere a cheap pass
    ranks the vocabulary, then each row's ``num_exact`` best logits are recomputed exactly from
    the float weights:

    A float32 head reads 4 bytes per weight every token (113 MB for SmolLM2's 49152 x 576,
    the largest read of a decode step). The cheap pass is fbgemm's dynamic int8 matmul
    (:mod:`~loopstack.engine.model.int8_dynamic`; 1.3 ms at one row and 2.1 ms at eight on one
    Xeon core) up to ``MAX_RESCORED_ROWS`` rows. Where torch lacks it: ``_weight_int8pack_mm``
    (3.5 ms and 12.8 ms) up to ``DENSE_ABOVE_ROWS`` rows, then a ``dense_dtype`` matmul
    (bfloat16) up to ``MAX_RESCORED_ROWS``. Their rounding alone costs KL ~2e-3 to the
    float32 model. With the top ``num_exact`` rescored,
    greedy choices and the probability mass that matters are exact; only the far tail keeps
    the approximation. More rows (all-position logits) use the float weights directly.
    """

    weight: torch.Tensor
    dense: torch.Tensor | None
    codes: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, num_exact: int = 128,
        dense_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.num_exact = min(num_exact, self.out_features)
        self.register_buffer("weight", weight.detach(), persistent=False)  # [V, H]; shares a tied embedding's storage
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        # 8-bit weights per group of 32 x 15-bit activations (the q4q8 kernel): precise enough to need
        # no rescoring (SmolLM2: logits within 0.01, KL 1e-7); else fbgemm's dynamic int8 or int8pack, rescored
        self.q8: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.out_features % 16 == 0 and self.in_features % 32 == 0 and extension.has_q4q8():
            self.q8 = pack_q8(weight)
        # a dense copy serves the rows the cheap passes below do not; the q8 head serves them all
        is_cheaper = dense_dtype is not None and dense_dtype.itemsize < weight.dtype.itemsize
        dense = weight.detach().to(dense_dtype) if is_cheaper and self.q8 is None else None
        self.register_buffer("dense", dense, persistent=False)
        self.packed = int8_dynamic.pack(weight) if self.q8 is None and int8_dynamic.available() else None
        self.smooth: torch.Tensor | None = None  # [H] divisor of the cheap pass's input; see calibrate
        if self.q8 is None and self.packed is None:
            w = weight.detach().float()
            scale = (w.abs().amax(-1) / 127).clamp(min=1e-8).to(torch.bfloat16)  # [V]
            codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("codes", codes, persistent=False)
            self.register_buffer("scales", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.weight.dtype)  # [M, H]
        num_rows, dense = rows.shape[0], self.dense
        if self.q8 is not None and num_rows <= MAX_Q8_HEAD_ROWS:
            logits = extension.q4q8_matmul(rows.float(), *self.q8).view(*x.shape[:-1], self.out_features)
            return logits if self.bias is None else logits + self.bias
        if self.packed is not None and num_rows <= MAX_RESCORED_ROWS:
            # the kernel quantizes its whole input with one scale: give every row the same range
            rows32 = rows.float() if self.smooth is None else rows.float() / self.smooth
            row_max = rows32.abs().amax(-1, keepdim=True).clamp_(min=1e-12)  # [M, 1]
            approx = int8_dynamic.matmul(rows32 / row_max, self.packed).mul_(row_max)
        elif num_rows <= DENSE_ABOVE_ROWS:
            approx = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.codes, self.scales)
        elif dense is not None and num_rows <= MAX_RESCORED_ROWS:
            approx = F.linear(rows.to(dense.dtype), dense)
        else:
            approx = None
        if approx is None:
            logits = F.linear(rows, self.weight)
        else:
            logits = approx.float()
            top_ids = logits.topk(self.num_exact, dim=-1, sorted=False).indices  # [M, k]
            top_weights = self.weight.index_select(0, top_ids.view(-1)).view(*top_ids.shape, -1)  # [M, k, H]
            # one matrix-vector product per row, not a bmm: a row's logits must not depend on how
            # many rows share the call (speculative verification relies on it)
            exact = torch.stack([torch.mv(top_weights[i], rows[i]) for i in range(num_rows)])  # [M, k]
            logits = logits.to(exact.dtype).scatter_(1, top_ids, exact)
        logits = logits.view(*x.shape[:-1], self.out_features)
        return logits if self.bias is None else logits + self.bias

    def calibrate(self, hidden: torch.Tensor, alpha: float = 0.5) -> None:
        """Move the activations' outlier channels into the weights of the cheap pass.

        The dynamic int8 kernel quantizes each input with one scale, so a few channels
        ~25x larger than the median (as in SmolLM2's final hidden states) cost the rest
        their precision. With ``hidden`` (``[N, H]`` sample inputs of this head), channel
        ``j`` is divided by ``s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)`` and its weight
        column multiplied by it (SmoothQuant); the product is unchanged, the ranges even out.
        SmolLM2-135M after rescoring: mean KL to the float32 model 8e-4 (1.4e-3 uncalibrated;
        5.7e-4 with the slower ``_weight_int8pack_mm`` pass). A no-op without the
        dynamic kernel (``_weight_int8pack_mm`` keeps activations in bfloat16).
        """
        if self.packed is None:
            return
        act_max = hidden.detach().reshape(-1, self.in_features).float().abs().amax(0).clamp(min=1e-5)
        weight_max = self.weight.float().abs().amax(0).clamp(min=1e-5)
        smooth = act_max.pow(alpha) / weight_max.pow(1 - alpha)  # [H]
        self.packed = int8_dynamic.pack(self.weight.float() * smooth)
        self.smooth = smooth


def quantize_model(
    model: nn.Module, mode: QuantMode, *, head: HeadMode | None = None, group_size: int = 32,
    dense_dtype: torch.dtype | None = None, int4_kernel: Literal["q4q8", "int4pack"] | None = None,
) -> int:
    """Replace the model's projections with weight-only quantized layers.

    Only for CPU models. Layers whose input size is not a multiple of ``group_size`` stay
    float in int4 mode. The output head (``lm_head``, or a copy of the tied embedding; the
    embedding lookup keeps its float table) is quantized with ``head``, or left float with
    ``None`` (the default: logits are more sensitive than the projections);
    ``"int8_rescored"`` is an :class:`Int8RescoredHead` (int8 speed, float top logits). Inputs of more
    than ``DENSE_ABOVE_ROWS`` rows (prefill) use the float weights in ``dense_dtype``:
    float32 keeps prefill exact, bfloat16 makes it ~3x faster end to end on CPUs with AMX
    or AVX512-BF16 (SmolLM2-135M: KL 3e-4 against float32); ``None`` picks bfloat16 where
    :func:`~loopstack.engine.device.cpu_has_fast_bfloat16`, else float32. ``int4_kernel``
    picks :class:`Int4Linear`'s format (``None``: q4q8 where it runs, else int4pack).
    Returns the number of layers replaced.

    Raises:
        ValueError: the model is not on the CPU, or an unknown mode.
    """
    if mode not in ("int4", "int8", "int8_dynamic") or head not in ("int4", "int8", "int8_dynamic", "int8_rescored", None):
        raise ValueError(
            f"unknown quantization mode={mode!r}, head={head!r}; expected 'int4', 'int8' or 'int8_dynamic' "
            "(head: also 'int8_rescored' or None)"
        )
    if "int8_dynamic" in (mode, head) and not int8_dynamic.available():
        raise ValueError("'int8_dynamic' needs fbgemm's dynamic int8 linear, which this torch build lacks")
    first = next(model.parameters())
    if first.device.type != "cpu":
        raise ValueError(f"weight-only quantization uses CPU kernels; the model is on {first.device}")
    if dense_dtype is None:
        dense_dtype = torch.bfloat16 if cpu_has_fast_bfloat16() else torch.float32

    def convert(linear_weight: torch.Tensor, bias: torch.Tensor | None, kind: HeadMode) -> nn.Module | None:
        if kind == "int8_rescored":
            return Int8RescoredHead(linear_weight, bias, dense_dtype=dense_dtype)
        if kind == "int8_dynamic":
            return DynamicInt8Linear(linear_weight, bias, dense_dtype)
        if kind == "int8":
            return Int8Linear(linear_weight, bias, dense_dtype)
        if linear_weight.shape[1] % group_size:
            return None
        return Int4Linear(linear_weight, bias, group_size, dense_dtype, int4_kernel)

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = head if parent is model and name == "lm_head" else mode
            if isinstance(child, nn.Linear) and kind and (new := convert(child.weight, child.bias, kind)):
                setattr(parent, name, new)
                replaced += 1
    embedding = getattr(model, "embed_tokens", None)
    is_tied = getattr(model, "lm_head", False) is None  # CausalLM: None means "reuse embed_tokens"
    new_head = None
    if head and is_tied and isinstance(embedding, nn.Embedding):
        new_head = convert(embedding.weight, None, head)
    if new_head is not None:
        model.lm_head = new_head
        replaced += 1
    is_all_bfloat16 = dense_dtype == torch.bfloat16 and isinstance(model, CausalLM) and all(
        isinstance(m, _WeightOnlyLinear) and m.kernel_dtype == torch.bfloat16
        for m in model.layers.modules() if isinstance(m, (nn.Linear, _WeightOnlyLinear))
    )
    if is_all_bfloat16 and isinstance(model, CausalLM):  # (isinstance again: mypy narrows here only)
        # every projection now computes in bfloat16 on both paths: feed it bfloat16 directly
        model.use_projection_dtype(torch.bfloat16)
    move_q4q8_weights_to_huge_pages(model)
    return replaced


def move_q4q8_weights_to_huge_pages(model: nn.Module) -> int:
    """Put what the q4q8 kernels stream every decode step (each q4q8 :class:`Int4Linear`'s codes
    and scales, an :class:`Int8RescoredHead`'s 8-bit codes and scales) side by side in one
    huge-page arena, in the model's order (see :mod:`~loopstack.engine.model.huge_pages`).
    Returns the bytes moved (0 where huge pages are off or there is nothing to move)."""
    linears = [m for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == "q4q8"]
    heads = [m for m in model.modules() if isinstance(m, Int8RescoredHead) and m.q8 is not None]
    tensors = [t for m in linears for t in (m.packed, m.scales_and_zeros)] + [t for h in heads for t in h.q8 or ()]
    copies = huge_pages.huge_page_copies(tensors)
    if not tensors or copies[0] is tensors[0]:
        return 0
    for i, linear in enumerate(linears):
        linear.packed, linear.scales_and_zeros = copies[2 * i], copies[2 * i + 1]
    for j, head in enumerate(heads):
        head.q8 = (copies[2 * len(linears) + 2 * j], copies[2 * len(linears) + 2 * j + 1])
    return sum(t.numel() * t.element_size() for t in copies)


CALIBRATION_TEXT = (
    "Paged attention keeps keys and values in fixed-size blocks, so sequences share memory.\n"
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
    '{"city": "Paris", "unit": "celsius", "days": [1, 2, 3]}\n'
    "Quelle est la capitale de la France ? The capital of France is Paris. 1, 2, 3, 5, 8, 13."
)


def calibrate_head(model: CausalLM, token_ids: list[int]) -> bool:
    """Run ``token_ids`` through ``model`` and :meth:`Int8RescoredHead.calibrate` its head
    on the final norm's outputs. Returns whether the head was calibrated."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, Int8RescoredHead) or head.packed is None or not token_ids:
        return False
    captured: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    try:
        num_blocks, block_size = -(-len(token_ids) // 16), 16
        cache = model.allocate_kv_cache(num_blocks, block_size)
        meta = AttentionMetadata.build([len(token_ids)], [len(token_ids)], [list(range(num_blocks))], block_size,
                                       device=model.device)
        with torch.inference_mode():
            model(torch.tensor(token_ids, device=model.device), meta.positions(), cache, meta,
                  torch.arange(len(token_ids), device=model.device))
    finally:
        hook.remove()
    head.calibrate(captured[0])
    return True
