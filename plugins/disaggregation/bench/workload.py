"""``loopstack bench --workload disagg``: colocated vs disaggregated serving at equal total cores.

Columns: ``colocated`` — one engine process with every core (chunked prefill: long prompts share
steps with the decodes); ``disaggregated`` — one prefill and one decode worker with one core each
(``-o connector=shm|tcp``), the pure split; ``mixed`` — the same two workers as a mixed pool (the
plugin's defaults): a prompt of at most ``short_prompt_tokens``, or any request once
``overflow_tokens`` prompt tokens are queued on the prefill worker, runs whole on the decode
worker, prefilled there 64 tokens a step; ``faults`` — the mixed router again, with every
``abort_every``-th trace request dropped by its client after its first token and the decode
worker killed (SIGKILL) halfway through the arrivals (the router restarts it), then every worker's
blocks, held requests, leases and imports counted once the run has drained (``leaked_*``: must be 0).

Each round replays the same mixed workload through the router: ``steady`` long decodes (short
prompt, ``steady_tokens`` greedy tokens) that run through the whole round, and requests shaped by
the Azure code trace (:mod:`.trace`: bursts of long prompts with short outputs) arriving on the
trace's clock. Measured per round: time to first token of the trace requests (p50, p99), the
steady decodes' inter-token latency as their client sees it (p50, p99), and output tokens per
second, and the engines' preemptions (a sequence whose KV no longer fits is recomputed from scratch
later). Every prompt starts with the round and column, so no request hits a prefix cached by an
earlier one. Both routers are up for the whole run; only one replays at a time.

Options (``-o``): ``requests`` (24), ``steady`` (2), ``steady_tokens`` (192), ``time_scale`` (4),
``token_scale`` (4), ``max_prompt`` (1200), ``connector`` (shm), ``abort_every`` (5),
``overflow_tokens`` (1024) and ``short_prompt_tokens`` (128): the mixed pool's, as the plugin's
defaults; ``start`` (0: the trace row the window starts at).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from loopstack.bench.workload import BenchOptionError, BenchOptions, Workload
from loopstack.engine.seams.replica_pool import usable_cpus
from loopstack.plugins.disaggregation.bench.trace import AZURE_CODE_TRACE, ScaledRequest, load_scaled_trace

__all__ = ["DisaggWorkload"]

COLUMNS = ("colocated", "disaggregated", "mixed", "faults")
TEXT = ("The quick brown fox jumps over the lazy dog while the compiler checks every branch of the "
        "parser, and the tests run on two cores. ")


@dataclass
class _Round:
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0
    aborted: int = 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class DisaggWorkload(Workload):
    name = "disagg"
    description = "TTFT, inter-token latency, throughput: colocated vs disaggregated and mixed (1P+1D), a fault run"
    default_steps = 2

    def __init__(self) -> None:
        self._routers: dict[str, Any] = {}
        self._trace: list[ScaledRequest] = []
        self._settings: dict[str, Any] = {}
        self._tokenizer: Any = None
        self._filler: list[int] = []

    def columns(self, stacks: list[Any]) -> list[str]:
        return list(COLUMNS)

    async def setup(self, columns: list[str], stacks: list[Any], options: BenchOptions) -> None:
        extra = options.extra
        try:
            settings = {
                "requests": int(extra.get("requests", 8 if options.quick else 24)),
                "steady": int(extra.get("steady", 2)),
                "steady_tokens": int(extra.get("steady_tokens", 48 if options.quick else 192)),
                "time_scale": float(extra.get("time_scale", 4.0)),
                "token_scale": float(extra.get("token_scale", 4.0)),
                "max_prompt": int(extra.get("max_prompt", 400 if options.quick else 1200)),
                "connector": str(extra.get("connector", "shm")),
                "abort_every": int(extra.get("abort_every", 5)),
                "overflow_tokens": int(extra.get("overflow_tokens", 1024)),
                "short_prompt_tokens": int(extra.get("short_prompt_tokens", 128)),
                "start": int(extra.get("start", 0)),
            }
        except ValueError as exc:
            raise BenchOptionError(f"disagg options: {exc}") from None
        if settings["connector"] not in ("shm", "tcp"):
            raise BenchOptionError(f"disagg: connector must be shm or tcp, got {settings['connector']!r}")
        self._settings = settings
        path = options.data_dir / AZURE_CODE_TRACE
        if not path.exists():
            raise BenchOptionError(f"the disagg bench needs {path} (../shared/data); it is not there")
        self._trace = load_scaled_trace(path, start=settings["start"], count=settings["requests"],
                                        time_scale=settings["time_scale"],
                                        token_scale=settings["token_scale"], max_prompt=settings["max_prompt"])
        self._routers = await asyncio.to_thread(self._start, settings)
        from loopstack.engine.loaders import load_tokenizer

        self._tokenizer, _ = load_tokenizer("smollm2-135m-instruct")
        self._filler = self._tokenizer.encode(TEXT * 200)

    @staticmethod
    def _start(settings: dict[str, Any]) -> dict[str, Any]:
        from loopstack.engine.llm_engine import EngineOptions
        from loopstack.inference.fleet import start_disaggregated_router, start_embedded_router
        from loopstack.plugins.disaggregation.plugin import DisaggregationConfig, topology_of

        cores = usable_cpus()
        options = EngineOptions(max_model_len=4096)
        common = {"dtype": "auto", "quantization": "int4", "native_decode": True}
        colocated = start_embedded_router("smollm2-135m-instruct", 1, options, threads_per_replica=cores, **common)
        routers = {"colocated": colocated}
        for name, overflow, short in (("disaggregated", 0, 0),
                                      ("mixed", settings["overflow_tokens"], settings["short_prompt_tokens"])):
            topology = topology_of(DisaggregationConfig(connector=settings["connector"], overflow_tokens=overflow,
                                                        short_prompt_tokens=short,
                                                        threads_per_worker=max(1, cores // 2)))
            routers[name] = start_disaggregated_router("smollm2-135m-instruct", topology, options, **common)
        return routers

    async def step(self, column: str, index: int) -> dict[str, float]:
        router = self._routers["mixed" if column == "faults" else column]
        faults = column == "faults"
        if faults:
            await asyncio.to_thread(_wait_healthy, router)
        preempted = await asyncio.to_thread(_preemptions, router)
        log = router.disaggregation.log if router.disaggregation is not None else None
        moved = (log.num_imported, log.total_bytes, log.total_seconds) if log is not None else (0, 0, 0.0)
        overflowed = log.num_overflowed if log is not None else 0
        result = await self._replay(router, f"{column}-{index}", faults)
        preempted = await asyncio.to_thread(_preemptions, router) - preempted
        metrics = {
            "ttft_p50_s": round(statistics.median(result.ttfts), 4) if result.ttfts else 0.0,
            "ttft_p99_s": round(_percentile(result.ttfts, 0.99), 4),
            "itl_p50_ms": round(1000 * statistics.median(result.itls), 2) if result.itls else 0.0,
            "itl_p99_ms": round(1000 * _percentile(result.itls, 0.99), 2),
            "tokens_per_s": round(result.tokens / self._wall, 2) if self._wall else 0.0,
            "failed": float(result.failed),
            "preemptions": float(preempted),
        }
        if log is not None and log.num_imported > moved[0]:  # what the hand-offs of this round moved
            count = log.num_imported - moved[0]
            nbytes, seconds = log.total_bytes - moved[1], log.total_seconds - moved[2]
            metrics["transfer_mb_mean"] = round(nbytes / count / 1e6, 2)
            metrics["transfer_ms_mean"] = round(1000 * seconds / count, 2)
            metrics["transfer_gb_per_s"] = round(nbytes / max(seconds, 1e-9) / 1e9, 2)
        if log is not None:
            metrics["overflowed"] = float(log.num_overflowed - overflowed)
        if faults:
            metrics["aborted"] = float(result.aborted)
            metrics.update(await asyncio.to_thread(_leaks, router))
        return metrics

    async def _replay(self, router: Any, tag: str, faults: bool) -> _Round:
        from loopstack.engine.sampling_params import SamplingParams

        result = _Round()
        marker = self._tokenizer.encode(f"[{tag}] ")
        settings = self._settings
        began = time.perf_counter()

        async def steady(n: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=settings["steady_tokens"], ignore_eos=True)
            prompt = marker + self._tokenizer.encode(f"steady {n}: ") + self._filler[n * 64 : n * 64 + 48]
            last = None
            try:
                async for output in router.stream(prompt, params):
                    now = time.perf_counter()
                    if last is not None and output.new_token_ids:
                        gap = (now - last) / len(output.new_token_ids)
                        result.itls.extend([gap] * len(output.new_token_ids))
                    last = now
                    result.tokens += len(output.new_token_ids)
                    if output.finished and output.error:
                        result.failed += 1
            except Exception:
                result.failed += 1

        async def traced(n: int, request: ScaledRequest) -> None:
            await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - began)))
            params = SamplingParams(temperature=0.0, max_tokens=request.output_tokens, ignore_eos=True)
            start = (n * 997) % max(1, len(self._filler) - request.prompt_tokens)
            prompt = marker + self._filler[start : start + request.prompt_tokens]
            sent, first = time.perf_counter(), True
            every = settings["abort_every"]
            abort = faults and every > 0 and n % every == every - 1
            stream = router.stream(prompt, params)
            try:
                async for output in stream:
                    if output.new_token_ids and first:
                        first = False
                        result.ttfts.append(time.perf_counter() - sent)
                        if abort:
                            result.aborted += 1
                            break
                    result.tokens += len(output.new_token_ids)
                    if output.finished and output.error:
                        result.failed += 1
            except Exception:
                result.failed += 1
            finally:
                await stream.aclose()

        async def killer() -> None:
            await asyncio.sleep(self._trace[len(self._trace) // 2].arrival_s)
            view = router.disaggregation
            pid = view.decode.replicas[0].pid
            if pid is not None:
                os.kill(pid, signal.SIGKILL)

        tasks = [steady(n) for n in range(settings["steady"])]
        tasks += [traced(n, request) for n, request in enumerate(self._trace)]
        if faults:
            tasks.append(killer())
        await asyncio.gather(*tasks)
        self._wall = time.perf_counter() - began
        return result

    async def teardown(self) -> None:
        for router in self._routers.values():
            await asyncio.to_thread(router.shutdown)

    def config(self) -> dict[str, Any]:
        return {**self._settings, "model": "smollm2-135m-instruct (int4, native decode)",
                "cores": usable_cpus(),
                "trace": f"{AZURE_CODE_TRACE} rows {self._settings['start']}-{self._settings['start'] + len(self._trace) - 1}, "
                         "gaps over 3 s cut to 3 s",
                "prompt_tokens": sum(r.prompt_tokens for r in self._trace)}

    _wall = 0.0


def _preemptions(router: Any) -> int:
    """Preemptions so far, over every engine process of ``router`` (a recomputed sequence each)."""
    view = router.disaggregation
    pools = [view.prefill, view.decode] if view is not None else [router.backends[0].pool]
    return sum(s.num_preemptions for pool in pools for s in router.loop.run(pool.statistics()))


def _wait_healthy(router: Any, timeout: float = 120.0) -> None:
    """Until every worker of a disaggregated router is alive again (after the last fault run)."""
    view = router.disaggregation
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r.is_alive for r in view.prefill.replicas + view.decode.replicas) and all(
                router.statistics().is_healthy):
            return
        time.sleep(0.1)
    raise RuntimeError("the disaggregated workers did not come back after the fault run")


def _leaks(router: Any, timeout: float = 30.0) -> dict[str, float]:
    """Every live worker's blocks, held requests, leases and imports once the run has drained."""
    view = router.disaggregation
    deadline = time.monotonic() + timeout
    while True:
        stats = router.loop.run(view.prefill.statistics()) + router.loop.run(view.decode.statistics())
        live = [s for s in stats if s.is_alive]
        leaks = {
            "leaked_blocks_prefill": float(sum(s.blocks.num_used_blocks for s in live[: len(view.prefill.replicas)]
                                               if s.blocks)),
            "leaked_blocks_decode": float(sum(s.blocks.num_used_blocks for s in stats[len(view.prefill.replicas):]
                                              if s.is_alive and s.blocks)),
            "leaked_leases": float(sum((s.connector or {}).get("leases_held", 0) for s in live)),
            "leaked_held_or_importing": float(sum(s.num_held + s.num_importing for s in live)),
        }
        if not any(leaks.values()) or time.monotonic() > deadline:
            return leaks
        time.sleep(0.1)
