"""Each policy's choice on constructed replica states."""

from __future__ import annotations

from collections import Counter

import pytest

from loopstack.engine.seams.kv_events import hash_token_blocks
from loopstack.inference import ReplicaView, RoundRobin, RouteDecision, RouteRequest
from loopstack.plugins.cache_routing.block_index import BlockIndex
from loopstack.plugins.cache_routing.cache_aware import Balance, CacheAware
from loopstack.plugins.cache_routing.policies import LeastLoad, RandomChoice, SessionAffinity
from loopstack.plugins.cache_routing.routing_history import RoutingHistory

BLOCK = 4


def request(tokens, *, key=None, salt=b"", at=0.0):
    return RouteRequest(list(tokens), BLOCK, salt=salt, cache_key=key, arrival_s=at)


def views(*in_flight, pending=None, unhealthy=()):
    pending = pending or [0] * len(in_flight)
    return [ReplicaView(i, is_healthy=i not in unhealthy, num_in_flight=n, num_pending_prefill_tokens=p)
            for i, (n, p) in enumerate(zip(in_flight, pending))]


def test_round_robin_cycles_and_skips_unhealthy():
    policy = RoundRobin()
    picks = [policy.choose(request(range(9)), views(0, 0, 0, unhealthy={1})).index for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_no_healthy_replica_is_an_error():
    with pytest.raises(ValueError, match="no healthy replica"):
        RandomChoice(seed=1).choose(request(range(9)), views(0, 0, unhealthy={0, 1}))


def test_random_covers_every_healthy_replica():
    policy = RandomChoice(seed=3)
    counts = Counter(policy.choose(request(range(9)), views(0, 0, 0, unhealthy={2})).index for _ in range(300))
    assert set(counts) == {0, 1} and min(counts.values()) > 100


def test_least_load_never_picks_the_busier_of_its_two_samples():
    policy = LeastLoad(seed=0)
    picks = Counter(policy.choose(request(range(9)), views(9, 0)).index for _ in range(50))
    assert picks == {1: 50}


def test_least_load_with_one_healthy_replica():
    assert LeastLoad(seed=0).choose(request(range(9)), views(5, 0, unhealthy={1})).index == 0


def test_session_affinity_is_sticky_and_moves_only_a_dead_replicas_keys():
    policy = SessionAffinity()
    keys = [f"session-{i}" for i in range(200)]
    before = {key: policy.choose(request(range(9), key=key), views(0, 0, 0, 0)).index for key in keys}
    assert before == {key: policy.choose(request(range(9), key=key), views(0, 0, 0, 0)).index for key in keys}
    assert len(set(before.values())) == 4
    after = {key: policy.choose(request(range(9), key=key), views(0, 0, 0, 0, unhealthy={2})).index for key in keys}
    moved = {key for key in keys if before[key] != after[key]}
    assert moved == {key for key in keys if before[key] == 2}
    assert 2 not in after.values()


def _indexed(holdings: dict[int, list[int]], num_replicas: int = 3) -> BlockIndex:
    index = BlockIndex(num_replicas)
    for replica, tokens in holdings.items():
        index.add(replica, hash_token_blocks(tokens, BLOCK))
    return index


def test_cache_aware_prefers_the_longest_cached_prefix():
    prompt = list(range(100, 133))  # 8 full blocks before the last token
    index = _indexed({0: prompt[:8], 1: prompt[:24], 2: []})
    policy = CacheAware(index=index, precise_replicas={0, 1, 2})
    decision = policy.choose(request(prompt), views(0, 0, 0))
    assert (decision.index, decision.reason, decision.predicted_cached_blocks) == (1, "cache_hit", 6)


def test_cache_aware_cost_sends_work_away_from_a_long_prefill_queue():
    prompt = list(range(100, 133))
    index = _indexed({1: prompt[:24]})
    policy = CacheAware(index=index, precise_replicas={0, 1, 2}, balance=Balance(queue_weight=1.0))
    # replica 1 holds 24 of 33 tokens, but 1,000 tokens of prefill are queued there
    decision = policy.choose(request(prompt), views(0, 3, 0, pending=[0, 1000, 0]))
    assert decision.index in (0, 2) and decision.reason == "load"
    assert decision.scores[1] > decision.scores[0]


def test_a_new_sessions_first_turn_weighs_queued_work_by_its_own_weight():
    """A shared system prompt held by replica 1 alone, 100 tokens queued there: a conversation's
    first turn (a key never routed) goes elsewhere at new_session_queue_weight 1; a known key's
    turn, and a request with no key, weigh the queue at queue_weight 0.1 and take the cache."""
    system = list(range(100, 116))  # 4 blocks every conversation starts with

    def prompt(start):
        return system + list(range(start, start + 17))  # 33 tokens, 8 full blocks

    balance = Balance(queue_weight=0.1, new_session_queue_weight=1.0)
    policy = CacheAware(index=_indexed({1: system}), precise_replicas={0, 1}, balance=balance)
    state = views(0, 1, pending=[0, 100])
    # replica 0: 33 uncached; replica 1: 17 uncached + 1.0 x 100 queued (+ 0.04 x 33 running)
    first = policy.choose(request(prompt(500), key="conversation-1"), state)
    assert (first.index, first.reason) == (0, "load")
    policy.on_routed(request(prompt(600), key="conversation-2"), RouteDecision(1, "load", 4))
    # 17 + 0.1 x 100 + 1.3 < 33
    assert policy.choose(request(prompt(700), key="conversation-2"), state).index == 1
    assert policy.choose(request(prompt(800)), state).index == 1  # no key
    off = CacheAware(index=_indexed({1: system}), precise_replicas={0, 1}, balance=Balance(new_session_queue_weight=None))
    assert off.choose(request(prompt(900), key="conversation-3"), state).index == 1


def test_cache_aware_threshold_balances_when_the_gap_is_large():
    prompt = list(range(100, 133))
    index = _indexed({1: prompt[:24]})
    balance = Balance(kind="threshold", balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy = CacheAware(index=index, precise_replicas={0, 1, 2}, balance=balance)
    assert policy.choose(request(prompt), views(2, 3, 2)).index == 1  # small gap: the cache wins
    assert policy.choose(request(prompt), views(1, 9, 2)).index == 0  # 9 - 1 > 4 and 9 > 1.5: load wins


def test_cache_aware_never_picks_an_unhealthy_holder():
    prompt = list(range(100, 133))
    policy = CacheAware(index=_indexed({1: prompt}), precise_replicas={0, 1, 2})
    assert policy.choose(request(prompt), views(0, 0, 0, unhealthy={1})).index != 1


def test_cache_aware_spreads_cold_requests():
    policy = CacheAware(index=BlockIndex(3), precise_replicas={0, 1, 2})
    picks = {policy.choose(request(range(i * 50, i * 50 + 33)), views(0, 0, 0)).index for i in range(6)}
    assert picks == {0, 1, 2}


def test_prompt_cache_key_is_a_hint_when_nothing_is_cached():
    policy = CacheAware(history=RoutingHistory())
    first = policy.choose(request(range(33), key="conversation-7"), views(0, 0, 0))
    policy.on_routed(request(range(33), key="conversation-7"), first)
    # a prompt sharing nothing, same key: follows the key
    again = policy.choose(request(range(500, 533), key="conversation-7"), views(1, 0, 0) if first.index == 0 else views(0, 0, 0))
    assert (again.index, again.reason) == (first.index, "affinity")


def test_approximate_mode_learns_from_its_own_routing():
    policy = CacheAware(history=RoutingHistory(ttl_s=10))
    prompt = list(range(33))
    first = policy.choose(request(prompt, at=0), views(0, 0, 0))
    policy.on_routed(request(prompt, at=0), first)
    follow_up = prompt + list(range(900, 940))
    assert policy.choose(request(follow_up, at=5), views(0, 0, 0)).index == first.index
    decision = policy.choose(request(follow_up, at=20), views(0, 0, 0))  # the TTL has passed
    assert decision.predicted_cached_blocks == 0


def test_tenants_never_match_each_others_blocks():
    prompt = list(range(33))
    index = BlockIndex(2)
    index.add(1, RouteRequest(prompt, BLOCK, salt=b"tenant-a").block_hashes)
    policy = CacheAware(index=index, precise_replicas={0, 1})
    assert policy.choose(request(prompt, salt=b"tenant-a"), views(0, 0)).predicted_cached_blocks == 8
    other = policy.choose(request(prompt, salt=b"tenant-b"), views(0, 0))
    assert other.predicted_cached_blocks == 0
    assert index.match(RouteRequest(prompt, BLOCK, salt=b"tenant-b").block_hashes) == {}
