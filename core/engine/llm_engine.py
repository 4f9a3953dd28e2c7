"""The synchronous engine core: add requests, step, collect outputs.

``LLMEngine`` is driven by one thread (see :mod:`loopstack.engine.async_engine` for the
asyncio front). Requests are validated when added — a bad one raises there and never
reaches the step loop — so one request's error cannot stop the others.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.cache_options import KVCacheOptions, Retention
from loopstack.engine.capture import CaptureAccumulator, HiddenCapture, check_capture
from loopstack.engine.errors import EngineError
from loopstack.engine.kept_logits import KeptLogits
from loopstack.engine.kv_tier import make_tier
from loopstack.engine.model.llama import CausalLM
from loopstack.engine.model_runner import ModelRunner, kv_bytes_per_token, resolve_kv_cache_dtype, weight_bytes
from loopstack.engine.request_log import RequestLog
from loopstack.engine.sampler import sample, token_logprobs
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.scheduler import ScheduledChunk, Scheduler
from loopstack.engine.seams.kv_events import KVEventBus
from loopstack.engine.seams.speculation import ProposerContext, SpeculationSpec
from loopstack.engine.sequence import FinishReason, Sequence, StopChecker
from loopstack.engine.speculator import SpeculationStatistics, Speculator
from loopstack.engine.text.grammar import GrammarBackend
from loopstack.engine.text.tokenizer import Tokenizer

__all__ = ["EngineOptions", "LLMEngine", "PromptTooLongError", "RequestOutput", "Usage"]

CPU_KV_BUDGET_BYTES = 512 * 1024**2
GPU_KV_FRACTION = 0.5


class PromptTooLongError(EngineError, ValueError):
    """The prompt does not fit the context window with room for one output token."""


@dataclass(frozen=True)
class EngineOptions:
    """How one engine runs a loaded model: KV cache size and batching (the model's own shape is
    its :class:`~loopstack.engine.config.ModelConfig`; how to load it, ``build_engine``'s keywords)."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's
    enable_prefix_caching: bool = True
    kv_cache: KVCacheOptions = field(default_factory=KVCacheOptions)  # eviction policy, pins, tier, log
    kept_logits: int = 8  # last logits of this many recent prompts: the same prompt again needs no forward (0: off)
    kv_cache_dtype: str = "auto"  # auto (float16 under the C++ decode layers, else the model's) | float32 | float16 | bfloat16
    # the curve speculation prices drafts with: default (built in) | measure (this machine's, measured
    # once per model and kept: loopstack.engine.step_cost_probe; build_engine applies it)
    step_cost: str = "default"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    time_to_first_token_s: float | None
    speculation: SpeculationStatistics | None = None  # a speculating request's, on its last output
    forwards: int | None = None  # target forwards that appended its tokens (one per token unless it speculates)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    usage: Usage
    error: str | None = None
    logprobs: list[float | None] | None = None
    hidden_state: torch.Tensor | None = None  # [hidden] float32 on CPU: a finished HiddenCapture, once


def _default_num_blocks(model: CausalLM, options: EngineOptions, max_model_len: int, kv_dtype: torch.dtype) -> int:
    per_block = kv_bytes_per_token(model, kv_dtype) * options.block_size
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = int(free * GPU_KV_FRACTION)
    else:
        budget = CPU_KV_BUDGET_BYTES
    # at least one full-length sequence must fit
    return max(budget // per_block, -(-max_model_len // options.block_size) + 1)


class LLMEngine:
    """Continuous-batching engine over one model replica."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        options: EngineOptions | None = None,
        *,
        event_bus: KVEventBus | None = None,
    ) -> None:
        self.options = options = options or EngineOptions()
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = min(options.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings)
        kv_dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, model)
        num_blocks = options.num_kv_blocks or _default_num_blocks(model, options, self.max_model_len, kv_dtype)
        self.event_bus = event_bus
        cache = options.kv_cache
        self.block_manager = BlockManager(
            num_blocks, options.block_size, enable_prefix_caching=options.enable_prefix_caching, event_bus=event_bus,
            policy=cache.policy, max_pinned_blocks=int(cache.max_pinned_share * num_blocks),
        )
        self.kept_logits = KeptLogits(options.kept_logits) if options.kept_logits and options.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
            kept_logits=self.kept_logits,
        )
        self.runner = ModelRunner(model, self.block_manager, num_blocks, kv_dtype)
        self.block_manager.attach_block_copier(self.runner.copy_block_prefix)
        tier = make_tier(cache.tier, self.runner.kv_cache, cache.tier_blocks or num_blocks)
        if tier is not None:
            self.block_manager.attach_tier(tier)
            self.runner.tier = tier
        self.request_log = RequestLog(cache.request_log, options.block_size) if cache.request_log else None
        self.speculator = Speculator(
            ProposerContext(model.config.vocab_size, tuple(tokenizer.eos_token_ids), model.device, tokenizer,
                            weight_bytes(model)),
            self.block_manager, self.max_model_len,
        )
        self._grammar: GrammarBackend | None = None
        self._seqs: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}  # prefill-only requests handed off, blocks kept for a transfer
        self._capturing: set[str] = set()  # request ids with a pending capture: the capturing forward runs
        self._eos = set(tokenizer.eos_token_ids)
        self.quantization = "none"  # set by the factory when it quantizes the model
        self.num_steps = 0
        self.busy_s = 0.0  # wall time inside step(): forward passes and sampling
        self.num_computed_tokens = 0

    @property
    def grammar_backend(self) -> GrammarBackend:
        if self._grammar is None:
            self._grammar = GrammarBackend(self.tokenizer, self.model.config.vocab_size)
        return self._grammar

    # -- requests --------------------------------------------------------------------------

    def make_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, salt: str = "",
        capture: HiddenCapture | None = None, speculation: SpeculationSpec | None = None, prefill_only: bool = False,
        retention: Retention | None = None,
    ) -> Sequence:
        """Validate a request and build its sequence (safe from any thread; does not enqueue).

        ``capture`` asks for the mean hidden state of some prompt positions (see
        :class:`HiddenCapture`); it arrives as ``RequestOutput.hidden_state``. ``speculation``
        makes it decode speculatively (see :mod:`loopstack.engine.speculator`); its output is the
        same as without (token for token when greedy, in distribution when sampling).
        ``prefill_only``: the prefill side of a disaggregated request; after its first token it
        ends with ``FinishReason.HANDOFF`` unless it is complete (EOS, a stop, ``max_tokens``
        1), its blocks held until :meth:`release_held` (see :meth:`held_sequence`). ``retention``
        pins its prompt prefix in the prefix cache when it ends (see :meth:`BlockManager.pin`).

        Raises PromptTooLongError, InvalidGrammarError, InvalidHiddenCaptureError (a layer the
        model lacks, a span past the prompt), ValueError (empty prompt, bad token id).
        """
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_token_ids)} tokens; the context window is {self.max_model_len} "
                "(at least one token must be left for the output)"
            )
        if capture is not None:
            check_capture(capture, self.model.config, len(prompt_token_ids))
        seq = Sequence(request_id, list(prompt_token_ids), params, salt=salt,
                       capture=CaptureAccumulator(capture) if capture is not None else None,
                       speculation_spec=speculation, prefill_only=prefill_only, retention=retention)
        if params.grammar is not None:
            seq.grammar = self.grammar_backend.new_state(params.grammar)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        decoder = self.tokenizer.incremental_decoder(prompt_token_ids)
        seq.stop_checker = StopChecker(decoder, params.stop)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence from :meth:`make_sequence` (engine thread only)."""
        self._register(seq)
        self.scheduler.add(seq)

    def add_running_sequence(self, seq: Sequence) -> None:
        """Enter a sequence whose blocks this engine's block manager already holds, with their
        KV written (a KV import, see :mod:`loopstack.engine.seams.kv_transfer`): it decodes
        from the next step on. Raises ValueError if the id is taken or has no blocks."""
        if seq.request_id not in self.block_manager:
            raise ValueError(f"request id {seq.request_id!r} has no blocks in this engine")
        self._register(seq)
        self.scheduler.add_running(seq)

    def _register(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs or seq.request_id in self._held:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self._seqs[seq.request_id] = seq
        if seq.is_capturing:
            self._capturing.add(seq.request_id)
        if seq.speculation_spec is not None:
            self.speculator.attach(seq, seq.speculation_spec)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, salt: str = "",
        capture: HiddenCapture | None = None, speculation: SpeculationSpec | None = None, prefill_only: bool = False,
        retention: Retention | None = None,
    ) -> Sequence:
        seq = self.make_sequence(request_id, prompt_token_ids, params, salt=salt, capture=capture,
                                 speculation=speculation, prefill_only=prefill_only, retention=retention)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. None if it is unknown or already done."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self._capturing.discard(request_id)
        self._retire(seq)
        self.scheduler.finish(seq)
        self.speculator.detach(seq)
        seq.finish(FinishReason.ABORT)
        return self._output(seq, [], "")

    def held_sequence(self, request_id: str) -> Sequence | None:
        """A prefill-only request that ended with HANDOFF, its blocks still held; None if unknown
        or released (engine thread only)."""
        return self._held.get(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a held request (its KV transfer is done, failed or expired). Returns
        whether it was held."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        if request_id in self.block_manager:
            self._retire(seq)
            self.block_manager.free(request_id)
        return True

    @property
    def held_request_ids(self) -> list[str]:
        return list(self._held)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def unfinished_request_ids(self) -> list[str]:
        return list(self._seqs)

    def sequence(self, request_id: str) -> Sequence | None:
        """The unfinished request ``request_id`` (engine thread only); None if unknown or done."""
        return self._seqs.get(request_id)

    # -- the step loop ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report what every touched request got."""
        chunks = self.scheduler.schedule()
        outputs = [self._finish_failed(c.seq) for c in chunks if c.seq.is_finished]
        chunks = [c for c in chunks if not c.seq.is_finished]
        if not chunks:
            return outputs
        if not self.speculator.is_idle:
            chunks = self.speculator.plan(chunks, self.scheduler.max_num_batched_tokens)
        started = time.perf_counter()
        try:
            return outputs + self._run(chunks)
        finally:
            self.busy_s += time.perf_counter() - started

    def _run(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        logits = self.runner.execute(chunks, capture=True) if self._capturing else self.runner.execute(chunks)
        self.num_steps += 1
        self.num_computed_tokens += sum(c.end - c.start for c in chunks)
        for chunk in chunks:
            if not chunk.draft:  # a draft's KV is settled by its verification
                chunk.seq.num_computed_tokens = chunk.end
                self.block_manager.mark_computed(chunk.seq.request_id, chunk.seq.token_ids[: chunk.end])
        if self._capturing:
            outputs.extend(self._captured(chunks))
        sampling = [c for c in chunks if c.samples]
        if sampling:
            logits = self._with_kept_rows(sampling, logits)
        if sampling and logits is not None:
            outputs.extend(self._sample(sampling, logits))
        return outputs

    def _with_kept_rows(self, sampling: list[ScheduledChunk], logits: torch.Tensor | None) -> torch.Tensor | None:
        """The forward's rows with the kept rows of chunks that computed nothing put in their place."""
        if not any(c.seq.kept_logits is not None and c.start == c.end for c in sampling):
            return logits
        parts, row = [], 0
        for chunk in sampling:
            kept = chunk.seq.kept_logits
            if kept is not None and chunk.start == chunk.end:
                parts.append(kept[None])
                chunk.seq.kept_logits = None
                assert self.kept_logits is not None
                self.kept_logits.num_hits += 1
            else:
                assert logits is not None
                parts.append(logits[row : row + len(chunk.draft) + 1].float().cpu())
                row += len(chunk.draft) + 1
        if len(parts) == 1:
            # one kept row alone: a copy (grammars and penalties change rows in place) by numpy, whose
            # memcpy wakes no OpenMP team (torch's clone: 67 against 9 us on the engine's thread)
            return torch.from_numpy(parts[0].numpy().copy())
        return torch.cat(parts)

    def _captured(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """Outputs for captures this step finished on chunks that do not sample (a sampled
        token's output carries its capture itself)."""
        outputs = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.request_id in self._capturing and not seq.is_capturing:
                self._capturing.discard(seq.request_id)
                if not chunk.samples:
                    outputs.append(self._output(seq, [], ""))
        return outputs

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample one token per plain chunk; verify each draft chunk's rows (``1 + len(draft)`` of them)."""
        logits = logits.float().cpu()
        plain: list[tuple[Sequence, int]] = []  # (sequence, its row)
        drafted: list[tuple[Sequence, torch.Tensor]] = []
        row = 0
        for chunk in chunks:
            if chunk.end > chunk.start:  # a chunk that computed nothing sampled from kept logits
                chunk.seq.num_sampling_forwards += 1
            if chunk.draft:
                drafted.append((chunk.seq, logits[row : row + len(chunk.draft) + 1]))
            else:
                plain.append((chunk.seq, row))
            row += len(chunk.draft) + 1
        now = time.perf_counter()
        outputs = []
        if plain:
            rows = logits if not drafted else logits[[r for _, r in plain]]
            seqs = [seq for seq, _ in plain]
            for i, seq in enumerate(seqs):
                if self.kept_logits is not None and not seq.output_token_ids and seq.capture is None:
                    self.kept_logits.put(seq.salt, seq.prompt_token_ids, rows[i])  # its prompt's last row, unmasked
                if seq.grammar is not None:
                    seq.grammar.mask_logits(rows[i])
            result = sample(rows, [s.params for s in seqs], [s.generator for s in seqs])
            for i, seq in enumerate(seqs):
                if seq.first_token_time is None:
                    seq.first_token_time = now
                outputs.append(self.append_token(seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i]))
        for seq, rows in drafted:
            outputs.append(self._append_verified(seq, rows))
        return outputs

    def _append_verified(self, seq: Sequence, rows: torch.Tensor) -> RequestOutput:
        """Append what the verification of ``seq``'s draft keeps, as one output; stops where the
        sequence ends (a stop string, EOS or max_tokens inside the kept tokens)."""
        verdict = self.speculator.accept(seq, rows)  # masks the rows with the grammar, rolls KV back
        tokens: list[int] = []
        text = ""
        logprobs: list[float | None] = []
        output = None
        for i, token in enumerate(verdict.token_ids):
            logprob, top = token_logprobs(rows[i], token, seq.params)
            output = self.append_token(seq, token, logprob, top)
            tokens += output.new_token_ids
            text += output.new_text
            logprobs += output.logprobs or []
            if seq.is_finished:
                break
        assert output is not None
        return self._output(seq, tokens, text, logprobs if seq.params.logprobs is not None else None)

    def append_token(
        self, seq: Sequence, token: int, logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None
    ) -> RequestOutput:
        """Append a token chosen for ``seq`` (sampled, or an accepted speculative draft whose KV
        is computed): advance its grammar and stop checks, finish and release it when it ends,
        and return the step's output for it."""
        if seq.grammar is not None and not seq.grammar.accept(token):
            seq.finish(FinishReason.ERROR, "the grammar allowed no token (an unsatisfiable schema?)")
            self._release(seq)
            return self._output(seq, [], "")
        seq.output_token_ids.append(token)
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top_logprobs)
        params = seq.params
        is_eos = (token in self._eos and not params.ignore_eos) or token in params.stop_token_ids
        stop_checker = seq.stop_checker
        assert stop_checker is not None  # make_sequence gives every sequence one
        text, stop_hit = ("", False) if is_eos else stop_checker.feed(token)
        if is_eos or stop_hit or (seq.grammar is not None and seq.grammar.is_terminated):
            seq.finish(FinishReason.STOP)
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish(FinishReason.LENGTH)
        elif seq.prefill_only:  # the decode side goes on from here, with text held back as it is now
            seq.finish(FinishReason.HANDOFF)
        if seq.is_finished and not stop_hit and seq.finish_reason is not FinishReason.HANDOFF:
            text += stop_checker.flush()
        seq.output_text += text
        if seq.is_finished:
            self._release(seq)
        return self._output(seq, [token], text, [logprob] if params.logprobs is not None else None)

    def _release(self, seq: Sequence) -> None:
        handoff = seq.finish_reason is FinishReason.HANDOFF
        final = self._ends_session(seq)
        if not handoff:
            self._retire(seq, final=final)
        self.scheduler.finish(seq, keep_blocks=handoff, final=final)
        if handoff:
            self._held[seq.request_id] = seq
        self.speculator.detach(seq)
        self._seqs.pop(seq.request_id, None)
        self._capturing.discard(seq.request_id)

    @staticmethod
    def _ends_session(seq: Sequence) -> bool:
        """A normal stop whose output its retention calls final (an agent's answer, no tool call)."""
        return (seq.finish_reason is FinishReason.STOP and seq.retention is not None
                and seq.retention.ends_session(seq.output_text))

    def _retire(self, seq: Sequence, *, final: bool = False) -> None:
        """Before a sequence's blocks go: pin what its retention asks for, write its log row."""
        request_id = seq.request_id
        if request_id not in self.block_manager:
            return
        pinned = 0
        if seq.retention is not None and seq.retention.ttl_s > 0:
            limit = len(seq.prompt_token_ids) if seq.retention.num_tokens is None else seq.retention.num_tokens
            pinned = self.block_manager.pin(request_id, ttl_s=seq.retention.ttl_s, num_tokens=limit,
                                            key=seq.retention.key) * self.block_manager.block_size
        if self.request_log is not None:
            now = time.perf_counter()
            epoch = time.time()
            computed = seq.token_ids[: self.block_manager.num_computed_tokens(request_id)]
            self.request_log.record(
                arrival_s=epoch - (now - seq.arrival_time), finish_s=epoch, prompt_token_ids=seq.prompt_token_ids,
                computed_token_ids=computed, salt=seq.salt.encode(), cached_tokens=seq.num_cached_prompt_tokens,
                pin_tokens=pinned, pin_ttl_s=seq.retention.ttl_s if pinned and seq.retention else 0.0,
                final=final,
            )

    def configure_kv_cache(self, options: KVCacheOptions) -> None:
        """Apply what may change while serving (engine thread only): the eviction policy and the pin
        share. The tier and the request log are fixed when the engine starts."""
        self.block_manager.set_policy(options.policy)
        self.block_manager.set_max_pinned_blocks(int(options.max_pinned_share * self.block_manager.num_blocks))

    def close(self) -> None:
        """Release what outlives steps (the request log's file)."""
        if self.request_log is not None:
            self.request_log.close()

    def _finish_failed(self, seq: Sequence) -> RequestOutput:
        self.speculator.detach(seq)
        self._seqs.pop(seq.request_id, None)
        self._capturing.discard(seq.request_id)
        return self._output(seq, [], "")

    def _output(self, seq: Sequence, tokens: list[int], text: str, logprobs=None) -> RequestOutput:
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        usage = Usage(len(seq.prompt_token_ids), seq.num_cached_prompt_tokens, len(seq.output_token_ids), ttft,
                      seq.speculation_statistics if seq.is_finished else None, seq.num_sampling_forwards)
        hidden_state = seq.capture.take_result() if seq.capture is not None else None
        return RequestOutput(
            seq.request_id, tokens, text, seq.is_finished, seq.finish_reason, usage, seq.error, logprobs, hidden_state
        )

    # -- convenience -------------------------------------------------------------------------

    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | None = None, *, salt: str = ""
    ) -> list[Sequence]:
        """Run prompts to completion in this thread (tests, scripts). Returns finished sequences."""
        params = params or SamplingParams()
        seqs = [self.add_request(f"gen-{self.num_steps}-{i}", list(p), params, salt=salt) for i, p in enumerate(prompts)]
        while any(not s.is_finished for s in seqs):
            self.step()
        return seqs

    def statistics(self) -> dict[str, object]:
        return {
            "blocks": self.block_manager.statistics()._asdict(),
            "scheduler": self.scheduler.statistics().__dict__,
            "steps": self.num_steps,
            "busy_s": self.busy_s,
            "computed_tokens": self.num_computed_tokens,
            "pending_captures": len(self._capturing),
            "held_for_transfer": len(self._held),
            "speculation": self.speculator.statistics.as_dict(),
        }
