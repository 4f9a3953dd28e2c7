"""Owns the model and its paged KV cache; turns scheduled chunks into one forward."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.capture import CaptureBatch
from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.scheduler import ScheduledChunk

__all__ = ["ModelRunner", "kv_bytes_per_token"]


def kv_bytes_per_token(model: CausalLM) -> int:
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8


class ModelRunner:
    """Runs forwards for the engine thread. Not thread-safe (one engine thread owns it)."""

    def __init__(self, model: CausalLM, block_manager: BlockManager, num_blocks: int) -> None:
        self.model = model
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, self.block_size)
        self.device = model.device

    @torch.inference_mode()
    def execute(self, chunks: Seq[ScheduledChunk], *, capture: bool = False) -> torch.Tensor | None:
        """One forward over every chunk; logits ``[S, V]`` for the chunks that sample, in order.

        ``capture``: some sequence may have a hidden-state capture pending (see
        :meth:`_execute_capturing`).
        """
        chunks = [c for c in chunks if c.end > c.start]
        if not chunks:
            return None
        meta, input_ids = self._metadata([(c.seq.request_id, c.seq.token_ids, c.start, c.end) for c in chunks])
        ends = torch.cumsum(torch.tensor([c.end - c.start for c in chunks]), 0) - 1
        if capture:
            return self._execute_capturing(chunks, meta, input_ids, ends)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            self.model(input_ids, meta.positions(), self.kv_cache, meta, logits_indices=ends[:1].to(self.device))
            return None
        logits_indices = ends[sampling].to(self.device)
        return self.model(input_ids, meta.positions(), self.kv_cache, meta, logits_indices=logits_indices)

    def _execute_capturing(
        self, chunks: list[ScheduledChunk], meta: AttentionMetadata, input_ids: torch.Tensor, ends: torch.Tensor
    ) -> torch.Tensor | None:
        """:meth:`execute`, adding the rows of each capturing sequence's positions in this batch
        to its :class:`~loopstack.engine.capture.CaptureAccumulator`."""
        batch = CaptureBatch.plan([(c.seq.capture, c.start, c.end) for c in chunks], self.device)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        logits = self.model(input_ids, meta.positions(), self.kv_cache, meta,
                            logits_indices=ends[sampling or [0]].to(self.device), captures=batch.layers)
        batch.deliver()
        return logits if sampling else None

    @torch.inference_mode()
    def score(self, seq_id: str, token_ids: Seq[int], start: int, end: int) -> torch.Tensor:
        """Compute tokens ``[start, end)`` of one sequence; logits at every one of them ``[end-start, V]``.

        The speculative-decoding seam: write a draft's KV and get the target's logits for
        each draft position in one forward (roll back with ``BlockManager.truncate``).
        """
        meta, input_ids = self._metadata([(seq_id, token_ids, start, end)])
        indices = torch.arange(end - start, device=self.device)
        return self.model(input_ids, meta.positions(), self.kv_cache, meta, logits_indices=indices)

    def _metadata(self, items: list[tuple[str, Seq[int], int, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        bm = self.block_manager
        meta = AttentionMetadata.build(
            query_lens=[end - start for _, _, start, end in items],
            context_lens=[end for _, _, _, end in items],
            block_tables=[bm.block_table(seq_id) for seq_id, _, _, _ in items],
            block_size=self.block_size,
            slot_mapping=[slot for seq_id, _, start, end in items for slot in bm.slot_mapping(seq_id, start, end)],
            device=self.device,
        )
        input_ids = torch.tensor(
            [t for _, tokens, start, end in items for t in tokens[start:end]], dtype=torch.long, device=self.device
        )
        return meta, input_ids

    def export_kv(self, block_ids: Seq[int]) -> torch.Tensor:
        """KV of ``block_ids`` as ``[num_layers, 2, n, block_size, kv_heads, head_dim]`` on CPU."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(2, index).cpu()

    def import_kv(self, block_ids: Seq[int], data: torch.Tensor) -> None:
        """Write ``data`` (from :meth:`export_kv`) into ``block_ids``."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, index, data.to(self.device, self.kv_cache.dtype))

