"""Move a running request, with its KV, from one engine to another (disaggregation seam).

``export_request`` snapshots a request in decode state: its tokens, sampling settings and
the KV of every computed token (a CPU tensor). ``import_request`` gives it blocks in the
other engine (reusing blocks that engine already caches for the same prefix, so only the
rest is copied), writes the KV and schedules it to continue decoding there. The source
then aborts its copy, which frees its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopstack.engine.llm_engine import LLMEngine
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.sequence import Sequence

__all__ = ["KVHandoff", "export_request", "import_request"]


@dataclass(frozen=True)
class KVHandoff:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    computed_token_ids: list[int]
    params: SamplingParams
    salt: str
    block_size: int
    kv: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim], CPU

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def export_request(engine: LLMEngine, request_id: str) -> KVHandoff:
    """Snapshot a running request and its computed KV. Raises KeyError if unknown."""
    seq = engine.sequence(request_id)
    if seq is None:
        raise KeyError(f"unknown request {request_id!r}")
    exported = engine.block_manager.export_blocks(request_id)
    return KVHandoff(
        request_id=request_id,
        prompt_token_ids=list(seq.prompt_token_ids),
        output_token_ids=list(seq.output_token_ids),
        computed_token_ids=list(exported.token_ids),
        params=seq.params,
        salt=seq.salt,
        block_size=exported.block_size,
        kv=engine.runner.export_kv(exported.block_ids),
    )


def import_request(engine: LLMEngine, handoff: KVHandoff) -> Sequence:
    """Continue ``handoff`` in ``engine``. Raises ValueError on a block-size mismatch and
    OutOfBlocksError when the engine has no room (nothing changes then)."""
    if handoff.block_size != engine.block_manager.block_size:
        raise ValueError(f"block size {handoff.block_size} != this engine's {engine.block_manager.block_size}")
    seq = engine.make_sequence(handoff.request_id, handoff.prompt_token_ids, handoff.params, salt=handoff.salt)
    assert seq.stop_checker is not None  # make_sequence gives every sequence one
    for token in handoff.output_token_ids:
        seq.stop_checker.feed(token)  # text state up to date; the text itself was already sent
        if seq.grammar is not None:
            seq.grammar.accept(token)
    seq.output_token_ids = list(handoff.output_token_ids)
    bm = engine.block_manager
    allocation = bm.import_sequence(handoff.request_id, handoff.computed_token_ids, salt=handoff.salt)
    first_block = allocation.num_cached_tokens // bm.block_size
    table = bm.block_table(handoff.request_id)
    num_blocks = handoff.kv.shape[2]
    if first_block < num_blocks:
        engine.runner.import_kv(table[first_block:num_blocks], handoff.kv[:, :, first_block:num_blocks])
    bm.mark_computed(handoff.request_id, handoff.computed_token_ids)
    seq.num_computed_tokens = len(handoff.computed_token_ids)
    seq.num_cached_prompt_tokens = min(allocation.num_cached_tokens, len(handoff.prompt_token_ids))
    engine.add_running_sequence(seq)
    return seq
