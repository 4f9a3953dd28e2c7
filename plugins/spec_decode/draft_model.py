"""Draft-model speculation: a smaller model with the target's tokenizer drafts k tokens ahead.

The draft runs in the target's engine thread, on the target's device, with its own paged KV cache
(its own :class:`~loopstack.engine.block_manager.BlockManager`, prefix caching on, the request's
cache salt kept). For each speculating sequence it remembers the tokens whose draft KV is written;
on the next proposal it keeps the longest prefix those share with the sequence now (the target
accepted part of the last draft, then added its own token), truncates the rest — the draft's KV
rolls back with the target's — and computes the new tokens and k draft tokens, every speculating
sequence of the step in one batched draft forward per draft position.

Greedy requests get the draft's argmax (a deterministic draft); sampling requests get tokens drawn
from the draft's distribution under the request's temperature, top-k and top-p, with those
distributions, so the engine's rejection sampling keeps the target's output distribution.

Its cost per draft token (a share of the target's decode step, for adaptive k) is the ratio of the
weights each model reads per step (:func:`~loopstack.engine.model_runner.weight_bytes`), unless
configured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loopstack.engine.block_manager import BlockManager, OutOfBlocksError, SharedBlockError
from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.model_runner import ModelRunner, weight_bytes
from loopstack.engine.sampler import sampling_probs
from loopstack.engine.seams.speculation import Proposal, ProposerContext, SpeculatingSequence
from loopstack.engine.text.tokenizer import Tokenizer

__all__ = ["DraftModelOptions", "DraftModelProposer", "DraftTokenizerMismatchError"]

_PROBE = "def add(a, b):\n    return a + b  # Hello, world! Überprüfung 123 ✓\n<|im_start|>user\nHi<|im_end|>"


class DraftTokenizerMismatchError(ValueError):
    """The draft model's tokenizer is not the target's: its drafts would be other tokens."""


@dataclass(frozen=True)
class DraftModelOptions:
    model: str = "smollm2-135m-instruct"  # a built-in name, a .gguf file or a Hugging Face directory
    num_layers: int | None = None  # keep only the first N layers of it (a layer-truncated draft)
    quantization: str = "auto"  # as the engine's (int4 on CPU, none on GPU)
    num_kv_blocks: int = 1024  # the draft's own KV cache, in blocks of block_size tokens
    block_size: int = 16
    cost_per_token: float | None = None  # share of the target's step per draft token; None: weight ratio


@dataclass
class _Tracked:
    """One sequence's draft state: the tokens whose draft KV is written."""

    known: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


class DraftModelProposer:
    """The ``draft_model`` proposer (see the module docstring). Engine thread only."""

    def __init__(self, context: ProposerContext, options: DraftModelOptions | None = None) -> None:
        from loopstack.engine.factory import build_engine  # the engine package imports this seam's types

        self.options = options = options or DraftModelOptions()
        engine = build_engine(options.model, EngineOptions(block_size=options.block_size,
                                                           num_kv_blocks=options.num_kv_blocks),
                              device=str(context.device), quantization=options.quantization,
                              num_layers=options.num_layers)
        _check_tokenizer(context.tokenizer, engine.tokenizer, options.model)
        self.model = engine.model
        self.max_model_len = engine.max_model_len
        self.vocab_size = context.vocab_size
        # the engine's paged cache is the draft's; its scheduler is not used (this proposer schedules)
        self.block_manager: BlockManager = engine.block_manager
        self.runner: ModelRunner = engine.runner
        if options.cost_per_token is not None:
            self.cost_per_token = options.cost_per_token
        elif context.target_weight_bytes:
            self.cost_per_token = weight_bytes(self.model) / context.target_weight_bytes
        else:
            self.cost_per_token = 0.0
        self._tracked: dict[str, _Tracked] = {}
        self.num_forwards = 0
        self.num_drafted = 0

    # -- Proposer --------------------------------------------------------------------------------

    def propose(self, seqs: Sequence[SpeculatingSequence], max_tokens: Sequence[int]) -> list[Proposal]:
        drafts: dict[int, list[int]] = {}  # index into seqs -> draft tokens so far
        probs: dict[int, list[torch.Tensor]] = {}
        tokens: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        limits: dict[int, int] = {}
        for i, (seq, limit) in enumerate(zip(seqs, max_tokens, strict=True)):
            ids = seq.prompt_token_ids + seq.output_token_ids
            limit = min(limit, self.max_model_len - len(ids))
            if limit <= 0:
                continue
            start = self._sync(seq, ids)
            if start is None:
                continue
            drafts[i], probs[i], tokens[i], starts[i], limits[i] = [], [], ids, start, limit
        active = list(drafts)
        while active:
            logits = self._forward([(seqs[i].request_id, tokens[i], starts[i]) for i in active])
            still = []
            for row, i in enumerate(active):
                token, dist = self._choose(seqs[i], logits[row])
                drafts[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
                starts[i] = len(tokens[i])
                tokens[i] = tokens[i] + [token]
                if len(drafts[i]) < limits[i] and self._reserve(seqs[i].request_id):
                    still.append(i)
            for i in active:
                if i not in still:  # the last draft token's KV is not written: it is not known
                    self._tracked[seqs[i].request_id].known = tokens[i][:-1]
                    self.block_manager.mark_computed(seqs[i].request_id, tokens[i][:-1])
            active = still
        self.num_drafted += sum(len(d) for d in drafts.values())
        return [Proposal(drafts[i], torch.stack(probs[i]) if probs.get(i) else None) if i in drafts else Proposal([])
                for i in range(len(seqs))]

    def finish(self, seq: SpeculatingSequence) -> None:
        if self._tracked.pop(seq.request_id, None) is not None and seq.request_id in self.block_manager:
            self.block_manager.free(seq.request_id)

    # -- helpers ---------------------------------------------------------------------------------

    def _sync(self, seq: SpeculatingSequence, ids: list[int]) -> int | None:
        """Roll the draft's KV of ``seq`` back to what it shares with ``ids`` and reserve slots for
        the rest; the first position to compute, or None (no room: no draft this step)."""
        bm = self.block_manager
        seq_id = seq.request_id
        tracked = self._tracked.get(seq_id)
        if tracked is None:
            tracked = self._tracked[seq_id] = _Tracked(generator=_generator(seq))
        if seq_id in bm:
            keep = min(_common_prefix(tracked.known, ids), len(ids) - 1)  # the last token is always computed
            try:
                bm.truncate(seq_id, keep)
            except SharedBlockError:  # a cut inside a shared prefix block: start this sequence over
                bm.free(seq_id)
        try:
            if seq_id not in bm:
                allocation = bm.allocate(seq_id, ids, salt=seq.salt or None)
                tracked.known = ids[: allocation.num_cached_tokens]
                return allocation.num_cached_tokens
            tracked.known = ids[: bm.num_tokens(seq_id)]
            bm.append_slots(seq_id, len(ids) - bm.num_tokens(seq_id))
            return len(tracked.known)
        except OutOfBlocksError:  # the draft's cache is full: this sequence decodes plainly this step
            if seq_id in bm:
                bm.free(seq_id)
            tracked.known = []
            return None

    def _reserve(self, seq_id: str) -> bool:
        """A slot for one more draft token's KV; False when the cache is full (the draft stops)."""
        try:
            self.block_manager.append_slots(seq_id, 1)
        except OutOfBlocksError:
            return False
        return True

    @torch.inference_mode()
    def _forward(self, items: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """Logits ``[len(items), V]`` after each sequence's ``tokens[start:]`` (their KV written)."""
        meta, input_ids = self.runner.metadata([(seq_id, tokens, start, len(tokens)) for seq_id, tokens, start in items])
        logits = self.model(input_ids, meta.positions(), self.runner.kv_cache, meta)
        self.num_forwards += 1
        return logits.float().cpu()

    def _choose(self, seq: SpeculatingSequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft token from one row of draft logits, and the distribution it was drawn from
        (None: greedy, a deterministic draft), in the target's vocabulary."""
        logits = _to_vocab(logits, self.vocab_size)
        if seq.params.is_greedy:
            return int(logits.argmax()), None
        dist = sampling_probs(logits[None], seq.params)[0]
        token = int(torch.multinomial(dist, 1, generator=self._tracked[seq.request_id].generator))
        return token, dist


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary (embedding tables are often padded differently)."""
    if logits.shape[-1] >= vocab_size:
        return logits[..., :vocab_size]
    pad = torch.full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def _generator(seq: SpeculatingSequence) -> torch.Generator | None:
    seed = seq.params.seed
    return torch.Generator().manual_seed(seed ^ 0x5DEECE66D) if seed is not None else None


def _check_tokenizer(target: Tokenizer, draft: Tokenizer, name: str) -> None:
    """Raise DraftTokenizerMismatchError unless ``draft`` tokenizes like ``target``."""
    probe_target, probe_draft = target.encode(_PROBE), draft.encode(_PROBE)
    if probe_target != probe_draft or set(target.eos_token_ids) != set(draft.eos_token_ids):
        raise DraftTokenizerMismatchError(
            f"draft model {name!r} does not share the target's tokenizer (a probe text encodes to "
            f"{probe_draft[:8]}... for it and {probe_target[:8]}... for the target; end tokens "
            f"{sorted(draft.eos_token_ids)} vs {sorted(target.eos_token_ids)}): pick a draft of the same family"
        )
