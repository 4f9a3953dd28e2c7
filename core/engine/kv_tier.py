"""Second-tier KV stores: where the block manager's evicted blocks go, and come back from on a hit.

Both implement :class:`~loopstack.engine.block_types.TierStore` over the model runner's cache tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; the block manager decides which
block goes to which slot and when.

- :class:`Int8Tier` (``tier = "int8"``, for CPU): K/V quantized to int8 with one scale per token and
  head (absmax over ``head_dim``), about half the bytes of a bf16 block and a quarter of fp32. It is
  lossy: a block loaded back is close to, not equal to, what was computed (docs/techniques/kv-cache.md
  measures how close, and what it saves).
- :class:`HostTier` (``tier = "host"``, for GPU): the exact K/V in host memory (pinned when the cache
  is on CUDA), copied on a side stream: saves and loads overlap the host's work, and the next forward
  waits for them (:meth:`HostTier.before_forward`). On CPU it is a plain copy (exact; a test double
  for the GPU path, and a measure of the bookkeeping's cost).
"""

from __future__ import annotations

import torch

__all__ = ["HostTier", "Int8Tier", "make_tier"]


def _slot_shape(kv_cache: torch.Tensor, num_slots: int) -> tuple[int, ...]:
    """``[num_slots, layers, 2, block_size, kv_heads, head_dim]``: one block of ``kv_cache`` per slot."""
    if num_slots < 1:
        raise ValueError(f"a tier needs at least one slot, got {num_slots}")
    layers, kv, _, block_size, heads, head_dim = kv_cache.shape
    return (num_slots, layers, kv, block_size, heads, head_dim)


class Int8Tier:
    medium = "CPU_INT8"

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        shape = _slot_shape(kv_cache, num_slots)
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        self.values = torch.zeros(shape, dtype=torch.int8)
        self.scales = torch.zeros((*shape[:-1], 1), dtype=torch.float16)

    @torch.inference_mode()
    def save(self, block_id: int, slot: int) -> None:
        block = self.kv_cache[:, :, block_id].to("cpu", torch.float32)
        scale = block.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        self.values[slot] = torch.round(block / scale).to(torch.int8)
        self.scales[slot] = scale.to(torch.float16)

    @torch.inference_mode()
    def load(self, slot: int, block_id: int) -> None:
        block = self.values[slot].to(torch.float32) * self.scales[slot].to(torch.float32)
        self.kv_cache[:, :, block_id] = block.to(self.kv_cache.device, self.kv_cache.dtype)

    def before_forward(self) -> None:
        """Nothing to wait for: copies are synchronous."""

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


class HostTier:
    medium = "CPU"

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        shape = _slot_shape(kv_cache, num_slots)
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        cuda = kv_cache.device.type == "cuda"
        self.values = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(kv_cache.device) if cuda else None

    @torch.inference_mode()
    def save(self, block_id: int, slot: int) -> None:
        if self._stream is None:
            self.values[slot].copy_(self.kv_cache[:, :, block_id])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))  # its KV is written
        with torch.cuda.stream(self._stream):
            self.values[slot].copy_(self.kv_cache[:, :, block_id], non_blocking=True)

    @torch.inference_mode()
    def load(self, slot: int, block_id: int) -> None:
        if self._stream is None:
            self.kv_cache[:, :, block_id].copy_(self.values[slot])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))  # nothing reads it any more
        with torch.cuda.stream(self._stream):
            self.kv_cache[:, :, block_id].copy_(self.values[slot], non_blocking=True)

    def before_forward(self) -> None:
        """The next forward reads loaded blocks and overwrites saved ones: it waits for the copies."""
        if self._stream is not None:
            torch.cuda.current_stream(self.kv_cache.device).wait_stream(self._stream)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes


def make_tier(kind: str, kv_cache: torch.Tensor, num_slots: int) -> Int8Tier | HostTier | None:
    """The tier ``kind`` names ("none", "int8", "host") over ``kv_cache``. Raises ValueError."""
    if kind == "none":
        return None
    if kind == "int8":
        return Int8Tier(kv_cache, num_slots)
    if kind == "host":
        return HostTier(kv_cache, num_slots)
    raise ValueError(f"unknown KV tier {kind!r}; known: none, int8, host")
