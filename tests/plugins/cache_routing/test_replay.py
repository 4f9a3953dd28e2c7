"""The trace replay: real block managers behind modelled replicas, every policy on the same trace."""

from __future__ import annotations

import random

import pytest

from loopstack.bench.runner import run_bench
from loopstack.bench.workload import BenchOptions
from loopstack.inference import RoundRobin
from loopstack.plugins.cache_routing.bench.replay import infinite_cache_hit_rate, replay
from loopstack.plugins.cache_routing.bench.trace import (
    AGENT_TRACE,
    MOONCAKE_TRACE,
    TraceRequest,
    load_agent_trace,
    load_trace,
)
from loopstack.plugins.cache_routing.bench.workload import RoutingWorkload
from loopstack.plugins.cache_routing.config import CacheRoutingConfig
from loopstack.plugins.cache_routing.plugin import build_policy
from tests.support import SHARED_DATA


def conversations(num_conversations=60, turns=5, seed=0, output_tokens=50):
    """Multi-turn conversations behind one shared system block: turn k extends turn k-1."""
    rng, requests, next_id = random.Random(seed), [], 1
    for conversation in range(num_conversations):
        ids = [0]
        start = rng.uniform(0, 600)
        for turn in range(turns):
            ids = ids + list(range(next_id, next_id + 3))
            next_id += 3
            requests.append(TraceRequest(start + turn * 30.0, len(ids) * 512, output_tokens, tuple(ids)))
    return sorted(requests, key=lambda request: request.arrival_s)


def run(policy_name, requests, num_replicas=4, capacity=200, **config):
    policy, index = build_policy(CacheRoutingConfig(policy=policy_name, **config), num_replicas=num_replicas)
    return replay(requests, policy, num_replicas=num_replicas, capacity_blocks=capacity, index=index)


def test_cache_aware_beats_round_robin_on_conversations():
    requests = conversations()
    round_robin, cache_aware = run("round_robin", requests), run("cache_aware", requests, mode="precise")
    assert cache_aware.hit_rate > 1.5 * round_robin.hit_rate
    assert cache_aware.hit_rate >= 0.95 * infinite_cache_hit_rate(requests)
    assert cache_aware.prefill_s < round_robin.prefill_s
    assert cache_aware.hit_rate <= infinite_cache_hit_rate(requests) + 1e-9
    assert cache_aware.predicted_hit_blocks == cache_aware.num_hit_blocks  # events keep the index exact


def test_under_load_cache_aware_spreads_conversations_over_the_replicas():
    requests = conversations(output_tokens=2000)  # 50 s of decode each: about 25 requests in flight
    cache_aware = run("cache_aware", requests, mode="precise")
    assert cache_aware.imbalance < 2.0  # a shared system prompt does not pull everything onto one replica
    assert cache_aware.hit_rate > 1.5 * run("round_robin", requests).hit_rate


def test_approximate_mode_is_close_to_precise_when_caches_are_large():
    requests = conversations()
    precise = run("cache_aware", requests, mode="precise", capacity=10_000)
    approximate = run("cache_aware", requests, mode="approximate", capacity=10_000)
    assert approximate.hit_rate >= 0.9 * precise.hit_rate


def test_one_big_replica_reaches_the_infinite_cache_bound():
    requests = conversations()
    result = replay(requests, RoundRobin(), num_replicas=1, capacity_blocks=100_000)
    assert result.hit_rate == pytest.approx(infinite_cache_hit_rate(requests))


def test_small_caches_evict_and_lower_the_hit_rate():
    requests = conversations()
    assert run("cache_aware", requests, capacity=40).hit_rate < run("cache_aware", requests, capacity=400).hit_rate


def test_a_request_larger_than_a_replica_is_an_error():
    with pytest.raises(ValueError, match="needs 6 blocks; a replica has 4"):
        replay([TraceRequest(0.0, 3000, 1, tuple(range(6)))], RoundRobin(), num_replicas=2, capacity_blocks=4)


@pytest.mark.skipif(not (SHARED_DATA / MOONCAKE_TRACE).exists(), reason=f"needs {SHARED_DATA / MOONCAKE_TRACE} (absent)")
def test_the_routing_bench_runs_on_the_real_trace():
    result = _run_quick_bench()
    hit_rate = result.metrics["hit_rate@8x2000"]
    assert hit_rate["cache_aware"] > 2.5 * hit_rate["round_robin"]
    assert result.metrics["imbalance@8x2000"]["cache_aware"] < 1.5
    assert result.config["infinite_cache_hit_rate"] > hit_rate["cache_aware"]
    assert len(load_trace(SHARED_DATA / MOONCAKE_TRACE, limit=10)) == 10


def _run_quick_bench():
    import asyncio

    return asyncio.run(run_bench(RoutingWorkload(), [], BenchOptions(quick=True, data_dir=SHARED_DATA), progress=False))


def test_the_live_replay_keeps_each_conversations_turns_extending_each_other():
    from loopstack.plugins.cache_routing.bench.live import build_replay

    replay = build_replay(conversations(num_conversations=5, turns=4), num_conversations=3, max_turns=3,
                          block_tokens=8, span_s=12.0)
    assert len(replay) == 9 and replay[0].at_s == 0.0 and replay[-1].at_s == 12.0
    by_key: dict[str, list] = {}
    for request in replay:
        by_key.setdefault(request.key, []).append(request)
    assert len(by_key) == 3
    for turns in by_key.values():
        for before, after in zip(turns, turns[1:]):
            assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
    first_blocks = {request.prompt_token_ids[:8] for request in replay}
    assert len(first_blocks) == 1  # the shared system block is the same tokens everywhere


@pytest.mark.skipif(not (SHARED_DATA / AGENT_TRACE).exists(), reason=f"needs {SHARED_DATA / AGENT_TRACE} (absent)")
def test_agent_sessions_become_append_only_block_chains():
    requests = load_agent_trace(SHARED_DATA / AGENT_TRACE, limit=3000)
    assert len(requests) == 3000 and all(r.hash_ids[0] == requests[0].hash_ids[0] for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    by_session: dict[int, list] = {}
    for request in requests:
        if len(request.hash_ids) > 1:
            by_session.setdefault(request.hash_ids[1], []).append(request)
    longest = max(by_session.values(), key=len)
    for before, after in zip(longest, longest[1:]):
        shorter = min(len(before.hash_ids), len(after.hash_ids))
        assert before.hash_ids[:shorter] == after.hash_ids[:shorter]
    assert infinite_cache_hit_rate(requests) > 0.5  # agent loops resend their history


def test_the_vllm_replay_passes_routing_options_to_loopstacks_cache_aware_columns_only():
    from loopstack.bench.workload import BenchOptionError
    from loopstack.plugins.cache_routing.bench.vllm_workload import VllmRoutingWorkload, _overrides

    workload = VllmRoutingWorkload()
    workload._overrides = _overrides({"queue_weight": "1", "columns": "loopstack_cache_aware"})
    assert workload._overrides == "queue_weight = 1.0"  # typed by the config: a TOML float
    assert workload._table("loopstack_cache_aware")[0].endswith("\nqueue_weight = 1.0")
    assert "queue_weight" not in workload._table("loopstack_session_affinity")[0]
    assert "queue_weight" not in workload._table("vllm_router_cache_aware")[0]
    with pytest.raises(BenchOptionError, match="unknown option.*'queue_wieght'"):
        _overrides({"queue_wieght": "1"})
    with pytest.raises(BenchOptionError, match="queue_weight"):
        _overrides({"queue_weight": "-1"})
