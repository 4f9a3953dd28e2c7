"""The step-cost curve of the machine the engine runs on: measured once, kept, reused.

:data:`~loopstack.engine.step_cost.DEFAULT_STEP_COST` was measured on one machine (2 Xeon cores
with AMX tiles). Elsewhere a step of ``n`` rows costs something else: on 2 Zen 4 cores (AVX-512
VNNI, no AMX) 8 rows cost 2.77 plain steps where the default says 1.94, and a GPU verifies rows
nearly for free. Drafts priced by another machine's curve come out too long or too short.

:func:`measure_step_cost` times the model itself, on a private engine of its own (a small KV cache
of its own, no event bus, no request log: nothing the serving engine reports or learns sees it).
One request decodes with a proposer whose every draft is rejected, so each step computes exactly
``k + 1`` rows. Every step of ``n`` rows is timed right after a one-row step, and a point of the
curve is the median of those pairs' ratios, over rounds in alternating order: this machine's speed
swings by up to 2x over tens of seconds (a shared host), and a ratio of adjacent steps does not
see a swing that slow, where separate phases of each row count did (one such phase measured 2 rows
at 2.1 one-row steps; adjacent pairs give 1.12-1.16). The curve is made non-decreasing and capped at
``n`` (a step of ``n`` rows costs at most ``n`` one-row steps). :class:`StepCostStore` keeps
curves in a JSON file by a fingerprint of what they depend on (model shape and bytes,
quantization, device, CPU, threads, kernels, KV dtype), so a machine measures once per model:
about 5 s for SmolLM2-135M on 2 CPU cores (a slower model takes fewer pairs, from 6 down to 2 a row
count, to stay near 10 s). :func:`machine_step_cost` is the two together.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from loopstack.engine.cache_dir import user_cache_dir
from loopstack.engine.step_cost import StepCost

if TYPE_CHECKING:
    from loopstack.engine.llm_engine import LLMEngine

__all__ = ["PROBE_ROWS", "STEP_COST_CHOICES", "RejectedDraft", "StepCostMeasurement", "StepCostStore",
           "apply_step_cost", "fingerprint", "machine_step_cost", "measure_step_cost"]

log = logging.getLogger(__name__)

STEP_COST_CHOICES = ("default", "measure")  # EngineOptions.step_cost
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)  # 33: the longest verification (k = 32, the spec's cap)
STORE_VERSION = 1
MAX_PROBE_S = 10.0  # the measurement's rough time budget: slow models take fewer pairs a row count
MAX_SPREAD = 0.3  # a measurement noisier than this is used but not kept (quiet runs here: 0.08-0.15)
# what changes a step's cost without changing the model (the kernels' switches)
_KERNEL_SWITCHES = ("LOOPSTACK_AMX", "LOOPSTACK_HUGE_PAGES", "LOOPSTACK_PREFETCH")


class RejectedDraft:
    """A proposer whose drafts are never accepted: ``k`` copies of a token the model does not
    predict there, so a step verifies exactly ``k + 1`` rows and emits one token. ``k`` is set
    between phases by whoever times the steps; None drafts as many as the engine allows (its
    spec's k). A test and measurement proposer."""

    def __init__(self, context: Any = None, token: int = 0) -> None:
        self.token = token
        self.k: int | None = None

    def propose(self, seqs: Sequence[Any], max_tokens: Sequence[int]) -> list[Any]:
        from loopstack.engine.seams.speculation import Proposal

        return [Proposal([self.token] * (limit if self.k is None else min(self.k, limit))) for limit in max_tokens]

    def finish(self, seq: Any) -> None:
        pass


def _probe_engine(engine: LLMEngine, context: int, max_rows: int, steps: int) -> LLMEngine:
    """An engine of its own over ``engine``'s model: a KV cache just large enough, nothing attached."""
    from loopstack.engine.llm_engine import EngineOptions, LLMEngine

    options = engine.options
    tokens = context + steps + 2 * max_rows + 16
    blocks = tokens // options.block_size + 4
    probe_options = EngineOptions(block_size=options.block_size, num_kv_blocks=blocks, max_num_seqs=1,
                                  max_num_batched_tokens=max(options.max_num_batched_tokens, max_rows + 1),
                                  max_model_len=engine.max_model_len, enable_prefix_caching=False, kept_logits=0,
                                  kv_cache_dtype=str(engine.runner.kv_cache.dtype).removeprefix("torch."))
    return LLMEngine(engine.model, engine.tokenizer, probe_options)


class StepCostMeasurement(NamedTuple):
    curve: StepCost
    spread: float  # the largest relative interquartile range of a point's pair ratios: how noisy it was
    one_row_s: float  # the median one-row step


def measure_step_cost(engine: LLMEngine, rows: Sequence[int] = PROBE_ROWS, *, steps: int = 6, rounds: int = 3,
                      context: int = 400) -> StepCostMeasurement:
    """Time ``steps`` steps of each of ``rows`` rows, each right after a one-row step, in ``rounds``
    rounds of alternating order, after a ``context``-token prompt, on a private engine over
    ``engine``'s model; the curve relative to one row (see the module docstring)."""
    from loopstack.engine.sampling_params import SamplingParams
    from loopstack.engine.seams.speculation import SpeculationSpec

    rows = sorted(set(rows) | {1})
    max_rows = rows[-1]
    context = max(8, min(context, engine.max_model_len - max_rows - 2 * (rounds * steps + 1) * len(rows) - 64))
    probe = _probe_engine(engine, context, max_rows, 2 * (rounds * steps + 1) * len(rows))
    proposer = RejectedDraft(token=engine.tokenizer.eos_token_ids[0] if engine.tokenizer.eos_token_ids else 0)
    spec = SpeculationSpec(lambda _context: proposer, key="step-cost-probe", num_speculative_tokens=max_rows - 1,
                           adaptive=False, max_batch_size=1)
    text = "The history of the printing press begins in the fifteenth century. " * 64
    prompt = (engine.tokenizer.encode(text) * 8)[:context]
    budget = 2 * (rounds * steps + 1) * len(rows) + max_rows + 8
    # the drafted token must stay rejected: EOS is what it drafts, so ignoring EOS keeps the request
    # running should the model ever predict it (the rows are computed either way)
    seq = probe.add_request(f"step-cost-probe-{time.monotonic_ns()}", prompt,
                            SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True), speculation=spec)
    while not seq.output_token_ids:  # prefill
        probe.step()
    # a slow model (say 50 ms a step) takes fewer pairs, so the probe stays about MAX_PROBE_S long
    plain_s = min(_timed_step(probe, proposer, 0) for _ in range(3))
    units = sum(1.0 + min(n, 1.0 + 0.3 * n) for n in rows[1:])  # a pair's cost, roughly, in plain steps
    steps = max(2, min(steps, int(MAX_PROBE_S / (plain_s * units * rounds))))
    ratios: dict[int, list[float]] = {n: [] for n in rows[1:]}
    one_row: list[float] = []
    for phase in range(rounds + 1):  # phase 0 warms every row count up and is not kept
        order = rows[1:] if phase % 2 else rows[:0:-1]
        for n in order:
            for _ in range(steps if phase else 1):
                plain = _timed_step(probe, proposer, 0)
                wide = _timed_step(probe, proposer, n - 1)
                if phase:  # each ratio of two adjacent steps: this machine's slower swings cancel
                    ratios[n].append(wide / plain)
                    one_row.append(plain)
    probe.abort(seq.request_id)
    spread = max(_relative_iqr(values) for values in ratios.values())
    points, highest = [(1, 1.0)], 1.0
    for n in rows[1:]:
        # a step never gets cheaper with more rows, nor dearer than that many one-row steps
        highest = min(max(highest, statistics.median(ratios[n])), float(n))
        points.append((n, round(highest, 3)))
    measured = StepCostMeasurement(StepCost(tuple(points)), spread, statistics.median(one_row))
    log.info("step cost measured: one row %.2f ms; %s (spread %.2f)", measured.one_row_s * 1e3,
             ", ".join(f"{n} rows {t:.2f}" for n, t in points[1:]), spread)
    return measured


def _relative_iqr(values: Sequence[float]) -> float:
    """The interquartile range of ``values`` over their median."""
    if len(values) < 4:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / median if median > 0 else 0.0


def _timed_step(engine: LLMEngine, proposer: RejectedDraft, k: int) -> float:
    proposer.k = k  # the step's plan asks for it
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def fingerprint(engine: LLMEngine) -> str:
    """What a step's cost depends on besides the rows: the model's shape and bytes, how it runs,
    on which device and CPU, with how many threads and which kernels."""
    from loopstack.engine.model_runner import weight_bytes

    model = engine.model
    config = model.config
    device = model.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{_cpu_name()} x{torch.get_num_threads()}"
    native = model.native_decoder
    kernels = getattr(native, "_ext", None)
    parts = [
        config.architecture, f"L{config.num_layers}", f"H{config.hidden_size}", f"I{config.intermediate_size}",
        f"V{config.vocab_size}", f"B{weight_bytes(model)}", engine.quantization, device.type, where,
        f"kv={engine.runner.kv_cache.dtype}", f"native={getattr(kernels, '__name__', None) if native else None}",
        *(f"{name}={os.environ[name]}" for name in _KERNEL_SWITCHES if name in os.environ),
    ]
    return " ".join(str(p) for p in parts)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class StepCostStore:
    """Measured curves by fingerprint, in one JSON file (default
    ``<user cache dir>/step_cost.json``). A file that cannot be read is measured over; one that
    cannot be written leaves the curve in memory only (both logged)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or user_cache_dir() / "step_cost.json"

    def entries(self) -> dict[str, Any]:
        """Every kept curve: fingerprint -> ``{"points": [[rows, time], ...], "measured": ISO time}``."""
        return self._read()

    def get(self, key: str) -> StepCost | None:
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return StepCost(tuple((int(n), float(t)) for n, t in entry["points"]))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring the step cost kept in %s for this machine (%s); measuring again", self.path, exc)
            return None

    def put(self, key: str, curve: StepCost) -> None:
        curves = self._read()
        curves[key] = {"points": [list(p) for p in curve.points],
                       "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            temporary.write_text(json.dumps({"version": STORE_VERSION, "curves": curves}, indent=1))
            os.replace(temporary, self.path)  # replicas measuring at once: the last whole file wins
        except OSError as exc:
            log.warning("could not keep the measured step cost in %s (%s); it is used, not kept", self.path, exc)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s); measuring the step cost again", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("version") != STORE_VERSION or not isinstance(data.get("curves"), dict):
            return {}
        return data["curves"]


def machine_step_cost(engine: LLMEngine, store: StepCostStore | None = None) -> StepCost:
    """``engine``'s curve on this machine: kept from an earlier measurement, or measured now and kept."""
    store = store or StepCostStore()
    key = fingerprint(engine)
    curve = store.get(key)
    if curve is not None:
        log.info("step cost of this machine from %s", store.path)
        return curve
    log.info("measuring this machine's step cost for speculative decoding (once per model: kept in %s)", store.path)
    measured = measure_step_cost(engine)
    if measured.spread > MAX_SPREAD:
        log.warning("the step cost measured now is noisy (pair ratios spread by %.0f%%: the machine is busy); "
                    "it is used but not kept, and measured again at the next start", measured.spread * 100)
    else:
        store.put(key, measured.curve)
    return measured.curve


def apply_step_cost(engine: LLMEngine) -> None:
    """Give ``engine``'s speculation the curve its ``options.step_cost`` asks for: ``default``
    (the built-in one) or ``measure`` (this machine's, :func:`machine_step_cost`)."""
    choice = engine.options.step_cost
    if choice not in STEP_COST_CHOICES:
        raise ValueError(f"EngineOptions.step_cost: {choice!r}; allowed: {', '.join(STEP_COST_CHOICES)}")
    if choice == "measure":
        engine.speculator.step_cost = machine_step_cost(engine)
