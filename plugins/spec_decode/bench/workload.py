"""``loopstack bench --workload spec``: decode speed and acceptance, speculation off vs each proposer.

One embedded engine (the default model, as ``loopstack serve`` builds it) serves every column in
turn: ``off``, ``ngram``, ``suffix``, ``draft_model`` (the default model cut to its first
``draft_layers`` layers, drafting ``draft_k`` tokens with adaptive k off, so its raw cost and
acceptance show; with it on, the draft switches itself off here). Each column
decodes the same greedy requests (:mod:`.prompts`): the agent-shaped ones and open chat, at batch
1 (one request at a time) and batch 8 (eight at once). Decode tokens/s counts only steps in which
no request is prefilling, so prefill is not in it; the prefix cache is emptied before each group,
so every column computes the same prompts the same way, and the proposers start empty, so the
suffix global index only knows outputs of earlier requests of the same group (the ``recurring``
sessions), never an earlier run of the same request. Every output is compared token for token
with the ``off`` column's (``identical``: the share that match). ``{group}_drafting_steps``: the
share of a column's decode steps in which some request verified a draft (at batch 8 only the tail
of a batch, once at most ``max_batch_size`` requests are left, may draft).

Options (``-o``): ``max_tokens`` (192), ``per_kind`` (4 agent requests of each shape), ``chat`` (8),
``columns`` (a comma list of ``off,ngram,suffix,draft_model``; all), ``groups`` (a comma list
of ``agent_b1,chat_b1,agent_b8,chat_b8``; all), ``k`` (num_speculative_tokens; unset: each proposer's default, 24 for suffix and 7 for ngram), ``max_batch_size`` (the switch-off threshold, 4), ``draft_layers``
(8; 0 for the whole draft model), ``draft_k`` (3), ``pairs`` (2; 0 in ``--quick``: at batch 8 each proposer column also runs
``off`` and itself back to back this many times, ABBA, and reports ``{group}_paired_vs_off``, the
ratio of those runs' tokens/s, since the columns' own runs are minutes apart on a machine whose
speed swings more than the goal's 3%), ``draft_adaptive`` (0; 1: adaptive k on for the
draft, as a stack's default has it), ``step_cost`` (``measure``: drafts priced by this machine's
step-cost curve, measured once and kept, as a stack with speculation has it; ``default``: the
built-in curve), ``model`` (the target: a built-in name, a .gguf
file or a Hugging Face directory; the default model), ``draft_model`` (the draft, likewise; the
target), ``device`` (auto: CUDA where torch sees one). On a GPU, a Hugging Face pair with a shared
tokenizer: ``-o model=DIR -o draft_model=DIR -o draft_layers=0``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from loopstack.bench.workload import BenchOptionError, BenchOptions, Workload, named_subset
from loopstack.plugins.spec_decode.bench.prompts import SpecPrompt, agent_prompts, chat_prompts

__all__ = ["SpecWorkload"]

COLUMNS = ("off", "ngram", "suffix", "draft_model")
GROUPS = ("agent_b1", "chat_b1", "agent_b8", "chat_b8")


@dataclass
class _Run:
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    drafting_steps: int = 0  # decode steps in which some sequence verified a draft
    outputs: list[list[int]] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


class SpecWorkload(Workload):
    name = "spec"
    description = "decode tokens/s, acceptance, tokens per verify: speculation off vs ngram, suffix and a draft model"
    default_steps = 1

    def __init__(self) -> None:
        self._engine: Any = None
        self._specs: dict[str, Any] = {}
        self._groups: dict[str, list[list[int]]] = {}
        self._reference: dict[str, list[list[int]]] = {}
        self._settings: dict[str, Any] = {}

    def columns(self, stacks: list[Any]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[Any], options: BenchOptions) -> None:
        from loopstack.engine.factory import build_engine
        from loopstack.engine.llm_engine import EngineOptions
        from loopstack.engine.loaders import DEFAULT_MODEL
        from loopstack.plugins.spec_decode.config import SpecDecodeConfig
        from loopstack.plugins.spec_decode.plugin import build_spec

        extra = options.extra
        try:
            settings: dict[str, Any] = {
                "max_tokens": int(extra.get("max_tokens", 48 if options.quick else 192)),
                "per_kind": int(extra.get("per_kind", 1 if options.quick else 4)),
                "chat": int(extra.get("chat", 2 if options.quick else 8)),
                "k": int(extra["k"]) if "k" in extra else None,
                "max_batch_size": int(extra.get("max_batch_size", 4)),
                "draft_layers": int(extra.get("draft_layers", 8)),
                "draft_k": int(extra.get("draft_k", 3)),
                "draft_adaptive": bool(int(extra.get("draft_adaptive", 0))),
                "model": str(extra.get("model", DEFAULT_MODEL)),
                "device": str(extra.get("device", "auto")),
                "step_cost": str(extra.get("step_cost", "measure")),
                "pairs": int(extra.get("pairs", 0 if options.quick else 2)),
            }
            settings["draft_model"] = str(extra.get("draft_model", settings["model"]))
        except ValueError as exc:
            raise BenchOptionError(f"spec options: {exc}") from None
        if settings["step_cost"] not in ("measure", "default"):
            raise BenchOptionError(f"spec option step_cost: {settings['step_cost']!r}; allowed: measure, default")
        chosen = named_subset(extra, "columns", COLUMNS, noun="column")
        if "off" not in chosen:
            raise BenchOptionError("spec option columns: every proposer is measured against 'off'; include it")
        columns[:] = [c for c in columns if c in chosen]
        groups = named_subset(extra, "groups", GROUPS, noun="group")
        self._settings = settings
        trajectories = options.data_dir / "trajectories"
        if not trajectories.is_dir():
            raise BenchOptionError(f"the spec bench needs {trajectories} (../shared/data); it is not there")
        self._engine = await asyncio.to_thread(
            build_engine, settings["model"], EngineOptions(max_model_len=4096, step_cost=settings["step_cost"]),
            device=settings["device"])
        tokenizer = self._engine.tokenizer

        def encode(prompts: list[SpecPrompt]) -> list[list[int]]:
            return [tokenizer.encode(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True))
                    for p in prompts]

        agent = encode(agent_prompts(options.data_dir, per_kind=settings["per_kind"]))
        chat = encode(chat_prompts(settings["chat"]))
        every = {"agent_b1": agent, "chat_b1": chat, "agent_b8": agent[:8], "chat_b8": chat[:8]}
        self._groups = {name: every[name] for name in GROUPS if name in groups}
        common = {"num_speculative_tokens": settings["k"], "max_batch_size": settings["max_batch_size"]}
        self._specs = {"off": None,
                       "ngram": build_spec(SpecDecodeConfig(proposer="ngram", **common)),
                       "suffix": build_spec(SpecDecodeConfig(proposer="suffix", **common)),
                       "draft_model": build_spec(SpecDecodeConfig(
                           proposer="draft_model", draft_model=settings["draft_model"],
                           draft_layers=settings["draft_layers"] or None, adaptive=settings["draft_adaptive"],
                           num_speculative_tokens=settings["draft_k"], max_batch_size=settings["max_batch_size"]))}
        await asyncio.to_thread(self._warm_up, agent[0])

    def _warm_up(self, prompt: list[int]) -> None:
        """A few plain and speculating steps before the first measured column, so that one-time
        costs (allocations, first-use paths) do not count against ``off``, the first column of the
        first round. (The larger swings seen here were the machine's own: see ``ratio_pairs``.)"""
        from loopstack.engine.sampling_params import SamplingParams

        for spec in (None, self._specs["ngram"]):
            seq = self._engine.add_request(f"warm-up-{time.monotonic_ns()}", prompt,
                                           SamplingParams(temperature=0.0, max_tokens=16), speculation=spec)
            while not seq.is_finished:
                self._engine.step()
        self._engine.block_manager.reset_prefix_cache()
        self._engine.speculator.proposers.clear()
        self._engine.speculator.calibrations.clear()

    async def step(self, column: str, index: int) -> dict[str, float]:
        return await asyncio.to_thread(self._measure, column)

    def _measure(self, column: str) -> dict[str, float]:
        engine, spec = self._engine, self._specs[column]
        stats = engine.speculator.statistics
        before = (stats.num_proposed, stats.num_accepted, stats.num_verifies, stats.num_emitted)
        metrics: dict[str, float] = {}
        same = total = 0
        for group, prompts in self._groups.items():
            batch = 8 if group.endswith("b8") else 1
            # a fresh proposer per group: the suffix global index must not remember this very request
            # from an earlier group or round (the groups share prompts, and greedy outputs repeat);
            # a draft model is kept (loading it takes seconds) with its prefix cache emptied; what the
            # engine learned of a proposer's confidences starts over too
            self._fresh_proposers()
            run = self._run(prompts, spec, batch)
            metrics[f"{group}_tok_s"] = round(run.tokens_per_s, 2)
            if spec is not None:
                metrics[f"{group}_drafting_steps"] = round(run.drafting_steps / run.decode_steps, 3) if run.decode_steps else 0.0
                if batch > 1 and self._settings["pairs"]:
                    metrics[f"{group}_paired_vs_off"] = self._paired(prompts, spec, batch)
            if column == "off":
                self._reference[group] = run.outputs or []
            reference = self._reference.get(group)
            if reference is not None and run.outputs is not None:
                same += sum(a == b for a, b in zip(run.outputs, reference, strict=True))
                total += len(reference)
        proposed, accepted, verifies, emitted = (a - b for a, b in zip(
            (stats.num_proposed, stats.num_accepted, stats.num_verifies, stats.num_emitted), before, strict=True))
        metrics["acceptance"] = round(accepted / proposed, 3) if proposed else 0.0
        metrics["tokens_per_verify"] = round(emitted / verifies, 3) if verifies else 0.0
        metrics["identical"] = round(same / total, 3) if total else 1.0
        return metrics

    def _fresh_proposers(self) -> None:
        engine = self._engine
        engine.speculator.calibrations.clear()
        for key, proposer in list(engine.speculator.proposers.items()):
            if hasattr(proposer, "block_manager"):
                proposer.block_manager.reset_prefix_cache()
            else:
                del engine.speculator.proposers[key]

    def _paired(self, prompts: list[list[int]], spec: Any, batch: int) -> float:
        """This proposer's decode tokens/s over ``off``'s on the same batches, run back to back
        (``pairs`` times, in ABBA order): the two columns' own runs are minutes apart, and this
        machine's speed swings more than the few percent the batch-8 goal is about."""
        runs: dict[bool, list[_Run]] = {False: [], True: []}
        for i in range(self._settings["pairs"]):
            for speculating in ((False, True) if i % 2 == 0 else (True, False)):
                self._fresh_proposers()
                runs[speculating].append(self._run(prompts, spec if speculating else None, batch))
        speed = {arm: sum(r.decode_tokens for r in rs) / sum(r.decode_s for r in rs) for arm, rs in runs.items()}
        return round(speed[True] / speed[False], 3)

    def _run(self, prompts: list[list[int]], spec: Any, batch: int) -> _Run:
        from loopstack.engine.sampling_params import SamplingParams

        engine = self._engine
        params = SamplingParams(temperature=0.0, max_tokens=self._settings["max_tokens"])
        run = _Run(outputs=[])
        for start in range(0, len(prompts), batch):
            engine.block_manager.reset_prefix_cache()
            seqs = [engine.add_request(f"spec-{time.monotonic_ns()}-{i}", ids, params, speculation=spec)
                    for i, ids in enumerate(prompts[start : start + batch])]
            while any(not s.is_finished for s in seqs):
                decoding = all(s.first_token_time is not None for s in seqs)
                tokens = sum(len(s.output_token_ids) for s in seqs)
                verifies = engine.speculator.statistics.num_verifies
                began = time.perf_counter()
                engine.step()
                if decoding:
                    run.decode_s += time.perf_counter() - began
                    run.decode_tokens += sum(len(s.output_token_ids) for s in seqs) - tokens
                    run.decode_steps += 1
                    run.drafting_steps += engine.speculator.statistics.num_verifies > verifies
            run.outputs.extend(s.output_token_ids for s in seqs)  # type: ignore[union-attr]
        return run

    def ratio_pairs(self, columns: list[str]) -> list[tuple[str, str]]:
        """Each proposer over ``off``: the ratio of the columns' mean tokens/s over the rounds. Not a
        mean of per-round ratios: the runner reverses the column order every other round, so a
        round's proposers may run before its ``off``, and this machine's speed swings by up to 2x
        over tens of seconds (a noisy neighbour): one slow ``off`` would lift every ratio it divides."""
        return [(column, "off") for column in columns if column != "off"]

    def config(self) -> dict[str, Any]:
        groups = {g: len(p) for g, p in self._groups.items()}
        engine = self._engine
        device = str(engine.model.device) if engine is not None else self._settings.get("device")
        k = {column: spec.num_speculative_tokens for column, spec in self._specs.items() if spec is not None}
        curve = [list(p) for p in engine.speculator.step_cost.points] if engine is not None else None
        return {**self._settings, "k": k, "groups": groups, "device": device, "step_cost_curve": curve}
