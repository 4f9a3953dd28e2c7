"""Attention over a paged KV cache.

The cache of one layer is two tensors (K and V) shaped ``[num_blocks, block_size,
num_kv_heads, head_dim]``; the token at position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``, i.e. at the flat slot
``block_id * block_size + offset``. The caller (the engine's block manager) owns the block
ids; this module only reads and writes the slots it is told to.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["AttentionMetadata", "allocate_kv_cache", "attention_kernels", "build_attention_mask", "contiguous_contexts", "paged_attention"]


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Where a batch of sequences sits in the paged KV cache, for one forward call.

    The forward's tokens are the new tokens of each sequence, concatenated in order
    (``T = sum(query_lens)``). Build it with :meth:`build`; the tensors are made once per
    forward and shared by every layer.

    Attributes:
        query_lens: new tokens of each sequence in this call.
        context_lens: tokens of each sequence in the cache after this call (cached + new).
        block_size: tokens per cache block.
        block_tables: ``[B, max_blocks]`` block ids of each sequence, padded with block 0
            past the blocks a sequence uses (padding is masked out).
        slot_mapping: ``[T]`` flat slot where each new token's K/V is written.
        query_index: ``[B, max_query_len]`` index into the ``T`` tokens of each sequence's
            i-th query; padding repeats the sequence's last token.
        output_index: ``[T]`` row of each token in the padded ``[B * max_query_len]`` output.
        context_lens_tensor: ``[B]`` the context lengths on the device.
        contiguous_first_block: with one sequence whose block ids are consecutive, its
            first block id (its context is then a slice of the cache, nothing to gather);
            else ``None``.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_size: int
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    output_index: torch.Tensor
    context_lens_tensor: torch.Tensor
    contiguous_first_block: int | None = None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        *,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Make the metadata of one forward call.

        Args:
            query_lens: new tokens per sequence (>= 1).
            context_lens: cached + new tokens per sequence (>= its query length).
            block_tables: block ids per sequence, covering at least its context length.
            block_size: tokens per block.
            slot_mapping: flat write slot of each new token; computed from the block tables
                (positions ``context_len - query_len .. context_len - 1``) when omitted.
            device: where the index tensors live (the model's device).

        Raises:
            ValueError: inconsistent lengths, or a block table too short for its context.
        """
        _validate(query_lens, context_lens, block_tables, block_size)
        num_seqs = len(query_lens)
        max_query_len = max(query_lens)
        max_blocks = max(-(-c // block_size) for c in context_lens)
        tables = [list(t[:max_blocks]) + [0] * (max_blocks - min(len(t), max_blocks)) for t in block_tables]
        if slot_mapping is None:
            slot_mapping = [
                table[p // block_size] * block_size + p % block_size
                for q, c, table in zip(query_lens, context_lens, block_tables, strict=True)
                for p in range(c - q, c)
            ]
        query_index: list[list[int]] = []
        output_index: list[int] = []
        start = 0
        for i, q in enumerate(query_lens):
            query_index.append([start + min(j, q - 1) for j in range(max_query_len)])
            output_index.extend(i * max_query_len + j for j in range(q))
            start += q
        long = torch.long
        first = tables[0][0]
        is_contiguous = num_seqs == 1 and tables[0] == list(range(first, first + max_blocks))
        return cls(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            block_size=block_size,
            block_tables=torch.tensor(tables, dtype=long, device=device),  # [B, max_blocks]
            slot_mapping=torch.as_tensor(slot_mapping, dtype=long, device=device),  # [T]
            query_index=torch.tensor(query_index, dtype=long, device=device).view(num_seqs, max_query_len),
            output_index=torch.tensor(output_index, dtype=long, device=device),  # [T]
            context_lens_tensor=torch.tensor(context_lens, dtype=long, device=device),  # [B]
            contiguous_first_block=first if is_contiguous else None,
        )

    @property
    def has_uniform_queries(self) -> bool:
        """All sequences have the same query length (no padding between them)."""
        return self.query_index.numel() == self.slot_mapping.numel()

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    @property
    def max_query_len(self) -> int:
        return self.query_index.shape[1]

    def positions(self) -> torch.Tensor:
        """``[T]`` position of each new token in its sequence."""
        device = self.slot_mapping.device
        return torch.cat(
            [torch.arange(c - q, c, device=device) for q, c in zip(self.query_lens, self.context_lens, strict=True)]
        )

    def last_token_indices(self, num_last: int = 1) -> torch.Tensor:
        """``[B * num_last]`` token indices of the last ``num_last`` new tokens of each sequence.

        Pass it as ``logits_indices`` to the model; ``num_last = k + 1`` gives the logits a
        speculative verifier needs. Raises ``ValueError`` if a sequence has fewer new tokens.
        """
        if num_last > min(self.query_lens):
            raise ValueError(f"num_last={num_last} exceeds the shortest query ({min(self.query_lens)})")
        indices: list[int] = []
        end = 0
        for q in self.query_lens:
            end += q
            indices.extend(range(end - num_last, end))
        return torch.tensor(indices, dtype=torch.long, device=self.slot_mapping.device)


def attention_kernels() -> AbstractContextManager[None]:
    """The SDPA kernels a CUDA forward may use: flash, memory-efficient, math — not cuDNN's.

    PyTorch prefers cuDNN's attention on Hopper, and builds a cuDNN plan for every new shape:
    decode and chunked prefill meet a new context length at every step, so each call paid
    about 1.4 ms of host time (an H200: 30 calls, ~40 ms of a batch-1 decode step whose GPU
    work is ~1.7 ms; docs/engine.md).
    """
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """One zeroed tensor holding every layer's cache.

    Returns ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; ``[i, 0]``
    and ``[i, 1]`` are layer ``i``'s K and V caches. One tensor lets a caller copy or ship a
    block of every layer with a single index: ``cache[:, :, block_ids]``.
    """
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def build_attention_mask(
    meta: AttentionMetadata, sliding_window: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """``[B, 1, max_query_len, max_blocks * block_size]`` additive mask: 0 = attend, -inf = not.

    Query ``i`` of a sequence sits at position ``context_len - query_len + i`` and sees keys
    at positions ``<=`` its own (and, with a sliding window, ``> position - window``). The
    mask is additive (in the model's ``dtype``) because SDPA would otherwise convert a bool
    mask in every layer.
    Returns ``None`` for one sequence that needs no mask (the window, if any, covers its
    whole context): a fresh prefill (plain causal attention over the new tokens) or a
    single query (it sees every cached key).
    """
    if (
        meta.num_seqs == 1
        and (meta.query_lens[0] == meta.context_lens[0] or meta.query_lens[0] == 1)
        and (sliding_window is None or sliding_window >= meta.context_lens[0])
    ):
        return None
    device = meta.slot_mapping.device
    num_keys = meta.block_tables.shape[1] * meta.block_size
    query_lens = torch.tensor(meta.query_lens, device=device)
    first_pos = meta.context_lens_tensor - query_lens  # [B]
    offsets = torch.arange(meta.max_query_len, device=device)
    # padded queries (i >= query_len) are clamped to the last real one: no all-masked rows
    query_pos = first_pos[:, None] + torch.minimum(offsets[None, :], query_lens[:, None] - 1)  # [B, Q]
    key_pos = torch.arange(num_keys, device=device)  # [K]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, K]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    additive = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
    return additive.unsqueeze(1)


def contiguous_contexts(kv_slots: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
    """Every layer's K and V of the one sequence of ``meta``, as a view of the cache.

    Args:
        kv_slots: ``[num_layers, 2, num_slots, num_kv_heads, head_dim]``, the cache with each
            block's slots flattened.
        meta: one sequence; its blocks must be consecutive (``meta.contiguous_first_block``).

    Returns:
        ``[num_layers, 2, 1, num_kv_heads, context_len, head_dim]`` (a view: writes to the
        cache show through), or ``None`` when ``meta`` is not one contiguous sequence.
        Made once per forward, it spares each layer a gather of its context.
    """
    if meta.contiguous_first_block is None:
        return None
    start = meta.contiguous_first_block * meta.block_size
    return kv_slots[:, :, None, start : start + meta.context_lens[0]].transpose(-2, -3)


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_slots: torch.Tensor,
    meta: AttentionMetadata,
    mask: torch.Tensor | None,
    scale: float,
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend each sequence's queries over its context.

    Args:
        q: ``[T, num_heads, head_dim]`` new queries (rotary already applied).
        kv: ``[2, T, num_kv_heads, head_dim]`` new keys (rotary applied) and values.
        kv_slots: ``[2, num_slots, num_kv_heads, head_dim]``, this layer's K and V cache with
            the slots of each block flattened (slot ``block_id * block_size + offset``).
        meta: where the sequences live in the cache.
        mask: from :func:`build_attention_mask`; ``None`` means one sequence attending
            causally over its whole context.
        scale: softmax scale (``head_dim ** -0.5``).
        context: this layer's slice of :func:`contiguous_contexts`, if the caller made it.

    Returns:
        ``[T, num_heads, head_dim]`` attention output.
    """
    num_heads, num_kv_heads, head_dim = q.shape[1], kv.shape[2], kv.shape[3]
    # a cache may be narrower than the model (float16 for a float32 model on CPU): every attention
    # reads K/V as the cache holds them, the fresh prefill below too, so a prompt's positions get
    # the same values whether their K/V were just computed or read back from cache
    stored = kv.to(kv_slots.dtype)  # no copy when the dtypes agree
    kv_slots.index_copy_(1, meta.slot_mapping, stored)
    if mask is None and meta.num_tokens > 1:
        # fresh prefill of one sequence: its context is exactly the new tokens.
        # 4-D inputs: with 3-D ones torch's CPU SDPA falls back to the (5x slower) math kernel
        k, v = stored.to(q.dtype).transpose(1, 2)[:, None]  # [1, Hkv, T, D] each
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale, enable_gqa=True,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1)
    group = num_heads // num_kv_heads
    if mask is None:
        # decode of one sequence over its whole context, no mask; the queries sharing a KV
        # head become that head's query rows (no KV repeat)
        if context is None:
            context = _gather_context(kv_slots, meta)[:, :, :, : meta.context_lens[0]]
        k_ctx, v_ctx = context.to(q.dtype)  # [1, Hkv, C, D] each
        out = F.scaled_dot_product_attention(q.view(1, num_kv_heads, group, head_dim), k_ctx, v_ctx, scale=scale)
        return out.reshape(1, num_heads, head_dim)  # from [1, Hkv, G, D] (a CUDA kernel's output may be strided)
    num_seqs = meta.num_seqs
    k_ctx, v_ctx = _gather_context(kv_slots, meta).to(q.dtype)  # [B, Hkv, K, D] each
    if meta.max_query_len == 1:
        # decode: as above, grouped queries with no KV repeat
        q_grouped = q.view(num_seqs, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(
            q_grouped, k_ctx, v_ctx, attn_mask=mask.expand(num_seqs, 1, group, mask.shape[-1]), scale=scale,
        )  # [B, Hkv, G, D]
        return out.reshape(num_seqs, num_heads, head_dim)
    if not meta.has_uniform_queries:
        return _attend_each(q, kv_slots, meta, mask, scale)
    q_pad = q.view(num_seqs, -1, num_heads, head_dim) if meta.has_uniform_queries else q[meta.query_index]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k_ctx, v_ctx, attn_mask=mask, scale=scale, enable_gqa=True,
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B * Q, H, D]
    return out if meta.has_uniform_queries else out[meta.output_index]


def _attend_each(
    q: torch.Tensor, kv_slots: torch.Tensor, meta: AttentionMetadata, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attention of a ragged batch (a chunked prefill next to decodes, say), one sequence at a time:
    each over exactly its own context. Padding every sequence to the longest query and context
    instead costs the batch ``B * max_query * max_context`` scores, many times the real ones
    (a 512-token chunk beside two decodes: three chunks' worth)."""
    num_heads, num_kv_heads, head_dim = q.shape[1], kv_slots.shape[2], kv_slots.shape[3]
    group = num_heads // num_kv_heads
    block_size = meta.block_size
    blocks = kv_slots.view(2, -1, block_size, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    start = 0
    for i, (query_len, context_len) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        num_blocks = -(-context_len // block_size)
        context = blocks.index_select(1, meta.block_tables[i, :num_blocks])  # [2, n, bs, Hkv, D]
        k, v = context.view(2, num_blocks * block_size, num_kv_heads, head_dim)[:, :context_len].to(q.dtype).transpose(1, 2)
        rows = q[start : start + query_len]
        if query_len == 1:  # a decode: the queries sharing a KV head are its rows (the mask: a window)
            attended = F.scaled_dot_product_attention(
                rows.view(1, num_kv_heads, group, head_dim), k[None], v[None],
                attn_mask=mask[i : i + 1, :, :1, :context_len], scale=scale,
            ).reshape(1, num_heads, head_dim)
        else:
            attended = F.scaled_dot_product_attention(
                rows.transpose(0, 1)[None], k[None], v[None], attn_mask=mask[i : i + 1, :, :query_len, :context_len],
                scale=scale, enable_gqa=True,
            )[0].transpose(0, 1)
        out[start : start + query_len] = attended
        start += query_len
    return out


def _gather_context(kv_slots: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """``[2, B, Hkv, max_blocks * block_size, D]``: each sequence's blocks, padded as its table is."""
    num_kv_heads, head_dim = kv_slots.shape[2], kv_slots.shape[3]
    blocks = kv_slots.view(2, -1, meta.block_size, num_kv_heads, head_dim)
    gathered = blocks.index_select(1, meta.block_tables.view(-1))  # [2, B * max_blocks, bs, Hkv, D]
    return gathered.view(2, meta.num_seqs, -1, num_kv_heads, head_dim).transpose(2, 3)


def _validate(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> None:
    if not (len(query_lens) == len(context_lens) == len(block_tables)) or not query_lens:
        raise ValueError(
            "query_lens, context_lens and block_tables must be non-empty and of equal length, got "
            f"{len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
        if not 1 <= q <= c:
            raise ValueError(f"sequence {i}: need 1 <= query_len ({q}) <= context_len ({c})")
        if len(table) * block_size < c:
            raise ValueError(
                f"sequence {i}: {len(table)} blocks of {block_size} cannot hold {c} tokens"
            )
