"""Owns the model and its paged KV cache; turns scheduled chunks into one forward."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.capture import CaptureBatch
from loopstack.engine.model.attention import AttentionMetadata
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.scheduler import ScheduledChunk

__all__ = ["KV_CACHE_DTYPES", "ModelRunner", "kv_bytes_per_token", "resolve_kv_cache_dtype", "weight_bytes"]


KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(name: str, model: CausalLM) -> torch.dtype:
    """The KV cache dtype the engine option ``kv_cache_dtype`` names; ``auto``: the model's choice
    (:attr:`CausalLM.kv_cache_dtype`: float16 under the C++ decode layers, else the model's dtype)."""
    if name == "auto":
        return model.kv_cache_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPES[name]


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype | None = None) -> int:
    """Bytes of KV cache one token takes in every layer (``dtype``: the cache's, default the model's choice)."""
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.finfo(dtype or model.kv_cache_dtype).bits // 8


def weight_bytes(model: CausalLM) -> int:
    """Bytes of ``model``'s weights as stored (parameters and buffers: quantized weights are
    buffers), but the embedding table, of which a step reads only its tokens' rows: about what
    one decode step reads, so two models' ratio is about their decode steps' (memory-bound) ratio."""
    embedding = model.embed_tokens.weight.data_ptr()
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for ptr, t in tensors.items() if ptr != embedding)


class ModelRunner:
    """Runs forwards for the engine thread. Not thread-safe (one engine thread owns it)."""

    def __init__(self, model: CausalLM, block_manager: BlockManager, num_blocks: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, self.block_size, dtype=kv_dtype)
        self.device = model.device
        self.tier: Any = None  # a second tier (loopstack.engine.kv_tier): the forward waits for its copies

    @torch.inference_mode()
    def execute(self, chunks: Seq[ScheduledChunk], *, capture: bool = False) -> torch.Tensor | None:
        """One forward over every chunk; logits for the chunks that sample, in order: ``1 +
        len(chunk.draft)`` rows each (a draft's every position is scored), ``[rows, V]``.

        ``capture``: some sequence may have a hidden-state capture pending (see
        :meth:`_execute_capturing`).
        """
        chunks = [c for c in chunks if c.end > c.start]
        if not chunks:
            return None
        if self.tier is not None:
            self.tier.before_forward()
        if not capture and len(chunks) > 1:
            split = self._rowwise_split(chunks)
            if split is not None:
                return self._execute_split(chunks, *split)
        return self._execute(chunks, capture=capture)

    def _rowwise_split(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[int], list[int], tuple[AttentionMetadata, torch.Tensor]] | None:
        """Where the model has a row-wise decoder (the CPU's native decode, whose rows are computed
        each alone), the decode and verification chunks of a batch that also prefills: their
        indices and the rest's. Run apart, a sequence's tokens come out bit for bit the same
        whatever else shares its steps (a prefill chunk beside it, more or fewer speculating
        rows); in one forward they would take the prefill's kernels in some steps and the row-wise
        ones in others, and a near-tie could turn either way. Also returns the row-wise group's
        metadata and input ids (built to ask the decoder, used by its forward). None: nothing to
        split."""
        native = self.model.native_decoder
        if native is None:
            return None
        rowwise = [i for i, c in enumerate(chunks) if 0 < c.start and c.end - c.start <= 1 + len(c.draft)]
        if not rowwise or len(rowwise) == len(chunks):
            return None
        prepared = self.metadata([(chunks[i].seq.request_id, chunks[i].token_ids, chunks[i].start, chunks[i].end)
                                  for i in rowwise])
        if not native.applies(prepared[0]):
            return None
        apart = set(rowwise)
        return rowwise, [i for i in range(len(chunks)) if i not in apart], prepared

    def _execute_split(self, chunks: list[ScheduledChunk], rowwise: list[int], rest: list[int],
                       prepared: tuple[AttentionMetadata, torch.Tensor]) -> torch.Tensor | None:
        """Two forwards (see :meth:`_rowwise_split`); the logits rows back in ``chunks`` order."""
        parts: dict[int, torch.Tensor] = {}
        for group, group_prepared in ((rowwise, prepared), (rest, None)):
            members = [chunks[i] for i in group]
            logits = self._execute(members, prepared=group_prepared)
            row = 0
            for i, chunk in zip(group, members, strict=True):
                if chunk.samples and logits is not None:
                    count = 1 + len(chunk.draft)
                    parts[i] = logits[row : row + count]
                    row += count
        ordered = [parts[i] for i in range(len(chunks)) if i in parts]
        return torch.cat(ordered) if ordered else None

    def _execute(self, chunks: list[ScheduledChunk], *, capture: bool = False,
                 prepared: tuple[AttentionMetadata, torch.Tensor] | None = None) -> torch.Tensor | None:
        """One forward over ``chunks`` (see :meth:`execute`); ``prepared``: their metadata and input
        ids, if already built."""
        meta, input_ids = prepared or self.metadata([(c.seq.request_id, c.token_ids, c.start, c.end) for c in chunks])
        ends = torch.cumsum(torch.tensor([c.end - c.start for c in chunks]), 0) - 1
        rows = [int(ends[i]) + j - len(c.draft) for i, c in enumerate(chunks) if c.samples
                for j in range(len(c.draft) + 1)]
        if capture:
            return self._execute_capturing(chunks, meta, input_ids, rows or [int(ends[0])])
        if not rows:
            self.model(input_ids, meta.positions(), self.kv_cache, meta, logits_indices=ends[:1].to(self.device))
            return None
        logits_indices = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model(input_ids, meta.positions(), self.kv_cache, meta, logits_indices=logits_indices)

    def _execute_capturing(
        self, chunks: list[ScheduledChunk], meta: AttentionMetadata, input_ids: torch.Tensor, rows: list[int]
    ) -> torch.Tensor | None:
        """:meth:`execute`, adding the rows of each capturing sequence's positions in this batch
        to its :class:`~loopstack.engine.capture.CaptureAccumulator`."""
        batch = CaptureBatch.plan([(c.seq.capture, c.start, c.end) for c in chunks], self.device)
        logits = self.model(input_ids, meta.positions(), self.kv_cache, meta,
                            logits_indices=torch.tensor(rows, dtype=torch.long, device=self.device),
                            captures=batch.layers)
        batch.deliver()
        return logits if any(c.samples for c in chunks) else None

    def metadata(self, items: list[tuple[str, Seq[int], int, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata and input ids of a batch: ``(seq_id, tokens, start, end)`` per sequence
        (its ``tokens[start:end]`` run; their slots reserved in the block manager)."""
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

    def copy_block_prefix(self, src_block_id: int, dst_block_id: int, num_tokens: int) -> None:
        """Copy the KV of block ``src``'s first ``num_tokens`` slots into block ``dst`` (every
        layer): the block manager's copier for partial prefix hits."""
        if self.tier is not None:
            self.tier.before_forward()  # a block the tier is still loading is read only after it lands
        self.kv_cache[:, :, dst_block_id, :num_tokens] = self.kv_cache[:, :, src_block_id, :num_tokens]

    def export_kv(self, block_ids: Seq[int]) -> torch.Tensor:
        """KV of ``block_ids`` as ``[num_layers, 2, n, block_size, kv_heads, head_dim]`` on CPU."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(2, index).cpu()

    def import_kv(self, block_ids: Seq[int], data: torch.Tensor) -> None:
        """Write ``data`` (from :meth:`export_kv`) into ``block_ids``."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, index, data.to(self.device, self.kv_cache.dtype))

