"""CPU memory in 2 MiB pages for what a decode step streams: the quantized weights.

A decode step of SmolLM2-135M on the q4q8 kernels reads ~60 MB of weights, tile after tile,
and every layer's KV cache. In 4 KiB pages that is ~15,000 pages a step, each with a TLB entry
of its own, and the hardware prefetcher does not follow a stream past a page's end. On Linux, where transparent huge
pages are ``madvise`` (the common default, and this project's machine), memory is given 2 MiB
pages only where asked for: this module asks. Measured (``scripts/ab_huge_pages.py``, one process,
alternating rounds): the batch-1 decode step 0.86-0.91x with the weights in huge pages, the
batch-8 one (bound by the kernels' arithmetic, not by memory) 0.99-1.00x.

The engine puts its q4q8 weights there (``quant.move_q4q8_weights_to_huge_pages``); its KV cache
stays in ordinary pages: in huge ones it measured 0.95-1.12x the step, no gain.

``LOOPSTACK_HUGE_PAGES=0`` turns it off (ordinary allocations). Elsewhere (no ``MADV_HUGEPAGE``,
not Linux) the same calls return ordinary tensors.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from collections.abc import Sequence

import torch

__all__ = ["HUGE_PAGE_BYTES", "huge_page_copies", "huge_page_zeros", "huge_pages_enabled"]

HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 64  # each tensor of an arena starts on a cache line
log = logging.getLogger("loopstack.engine")
_warned = False


def huge_pages_enabled() -> bool:
    """Whether allocations here ask for huge pages: Linux with ``MADV_HUGEPAGE``, unless
    ``LOOPSTACK_HUGE_PAGES=0``."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("LOOPSTACK_HUGE_PAGES", "1") != "0")


def _arena(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of zeroed uint8 memory starting on a 2 MiB boundary, advised as huge pages, or
    ``None`` where the mapping or the advice is refused (logged once). The tensor keeps its mapping
    alive (``torch.frombuffer`` holds a reference to it)."""
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE_BYTES  # the mapping starts on a 4 KiB page: so does this
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except (OSError, ValueError) as exc:
        global _warned
        if not _warned:
            _warned = True
            log.warning("huge pages unavailable (%s); weights stay in ordinary pages", exc)
        return None
    return whole[start : start + nbytes]


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in huge pages (an ordinary ``torch.zeros`` below 2 MiB or where
    :func:`huge_pages_enabled` is false)."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    arena = _arena(nbytes) if huge_pages_enabled() and nbytes >= HUGE_PAGE_BYTES else None
    if arena is None:
        return torch.zeros(tuple(shape), dtype=dtype)
    return arena.view(dtype).view(tuple(shape))


def huge_page_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU ``tensors`` side by side in one huge-page arena (each on a cache
    line), in order; the tensors themselves where :func:`huge_pages_enabled` is false or they add
    up to less than 2 MiB."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    arena = _arena(total) if huge_pages_enabled() and total >= HUGE_PAGE_BYTES else None
    if arena is None:
        return list(tensors)
    copies = []
    for tensor, offset, size in zip(tensors, offsets, sizes):
        copy = arena[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
    return copies
