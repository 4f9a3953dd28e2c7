"""Continuous batching with chunked prefill and preemption by recompute.

Every step gets a budget of prefill tokens. Running sequences go first (a decode, or any
one-token step, always runs and is not counted), then waiting ones are admitted while
blocks, budget and the sequence cap allow. A long prompt is cut into chunks of the budget,
so it never stalls the running decodes for more than one step's budget. A chunk is
scheduled whole or waits for a step with room for it: a prompt is therefore cut at the
same places (its start, then every budget's worth) whatever else shares its steps, and its
tokens come out the same alone or in any batch. When a decode cannot get
a block, the most recently admitted sequence is preempted: its blocks are freed and
it goes back to the front of the queue, to be recomputed (mostly from the prefix
cache) later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.kept_logits import KeptLogits
from loopstack.engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerStatistics"]


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``[start, end)`` of ``seq`` this step; sample if ``end`` is its last.

    ``draft``: speculative tokens after the sequence's last one (see :mod:`loopstack.engine.speculator`),
    computed in the same forward; ``end`` then counts them, and every one of them is scored.
    """

    seq: Sequence
    start: int
    end: int
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens + len(self.draft)

    @property
    def token_ids(self) -> list[int]:
        """The sequence's tokens with the draft after them."""
        return self.seq.token_ids + list(self.draft) if self.draft else self.seq.token_ids


@dataclass(frozen=True)
class SchedulerStatistics:
    num_waiting: int
    num_running: int
    num_preemptions: int


class Scheduler:
    """Decides, step by step, which tokens of which sequences run."""

    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
        kept_logits: KeptLogits | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.kept_logits = kept_logits  # a fresh prompt whose last logits are kept may compute nothing
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Run a sequence whose blocks are allocated and computed already (a KV import): no
        admission, it is scheduled with the running ones from the next step."""
        seq.admitted = True
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted by an earlier sequence this step
                continue
            size = self._chunk_size(seq)
            if size > budget:
                continue  # its next chunk, whole, waits for a step with room
            if not self._reserve(seq, seq.num_computed_tokens + size):
                continue  # seq itself was preempted
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, seq.num_computed_tokens + size))
            budget -= size if size > 1 else 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.token_ids
            reuse = seq.capture.max_cached_tokens if seq.capture is not None else None  # a capture's spans
            kept = self._kept_logits(seq)
            if not self.block_manager.can_allocate(tokens, salt=seq.salt, max_cached_tokens=reuse,
                                                   reuse_last=kept is not None):
                if not self.running and self.block_manager.num_sequences == 0:
                    # nothing will ever free blocks for it: fail it instead of waiting forever (blocks
                    # held for a transfer or an import on its way are freed or run soon: wait for them)
                    self.waiting.popleft()
                    seq.finish(FinishReason.ERROR, f"needs more KV blocks than the cache has ({len(tokens)} tokens)")
                    chunks.append(ScheduledChunk(seq, 0, 0))
                    continue
                break
            self.waiting.popleft()
            allocation = self.block_manager.allocate(seq.request_id, tokens, salt=seq.salt, max_cached_tokens=reuse,
                                                     reuse_last=kept is not None)
            seq.num_computed_tokens = allocation.num_cached_tokens
            if kept is not None and allocation.num_cached_tokens == len(tokens):
                seq.kept_logits = kept  # nothing to compute: its first token is sampled from these
            if not seq.admitted:
                seq.num_cached_prompt_tokens = allocation.num_cached_tokens
                seq.admitted = True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            size = self._chunk_size(seq)
            if size > budget:
                break  # admitted; its first chunk, whole, runs in a later step
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, seq.num_computed_tokens + size))
            budget -= size if size > 1 else 0
        return chunks

    def _chunk_size(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s next chunk: all that is left, at most a step's budget."""
        return min(seq.num_uncomputed, self.max_num_batched_tokens)

    def _kept_logits(self, seq: Sequence) -> torch.Tensor | None:
        """The kept last logits of a fresh plain request's prompt, if any."""
        if self.kept_logits is None or seq.admitted or seq.output_token_ids or seq.capture is not None:
            return None
        return self.kept_logits.get(seq.salt, seq.prompt_token_ids)

    def _reserve(self, seq: Sequence, end: int) -> bool:
        """Make sure slots up to ``end`` exist, preempting others (or ``seq``) if needed."""
        needed = end - self.block_manager.num_tokens(seq.request_id)
        if needed <= 0:
            return True
        while not self.block_manager.can_append(seq.request_id, needed):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.append_slots(seq.request_id, needed)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to the front of the queue and free its blocks; it is
        recomputed from scratch when readmitted (raises ValueError if it is not running)."""
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        seq.num_computed_tokens = 0
        if seq.capture is not None:
            seq.capture.restart()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, *, keep_blocks: bool = False, final: bool = False) -> None:
        """Remove a finished or aborted sequence and release its blocks (``keep_blocks``: they stay
        allocated under its id, for a KV transfer; the caller frees them; ``final``: it ended its
        session, see :meth:`BlockManager.free`)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_blocks and seq.request_id in self.block_manager:
            self.block_manager.free(seq.request_id, final=final)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(len(self.waiting), len(self.running), self._num_preemptions)
