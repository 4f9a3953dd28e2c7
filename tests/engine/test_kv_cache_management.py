"""Eviction policies, pinned prefixes and the second tier of the block manager (issue 23).

Each policy is tried on access patterns where the right eviction is known; the engine tests run the
tiny random-weight model (a test double for the real one: the point is the KV bookkeeping).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.cache_options import KVCacheOptions, Retention
from loopstack.engine.eviction import POLICIES, BlockUse, FrequencyPolicy, LRUPolicy, SLRUPolicy, make_policy
from loopstack.engine.kv_tier import HostTier, Int8Tier
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.kv_events import BlockRemoved, BlockStored, KVEventBus
from tests.engine.support import make_engine


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(bm: BlockManager, seq_id: str, tokens: Sequence[int], *, salt: str | None = None) -> int:
    """Allocate, compute, free: one request; returns its cached tokens."""
    cached = bm.allocate(seq_id, tokens, salt=salt).num_cached_tokens
    bm.mark_computed(seq_id, tokens)
    bm.free(seq_id)
    return cached


def prompt(tag: int, num_blocks: int, size: int = 2) -> list[int]:
    """``num_blocks`` full blocks unique to ``tag``, then one token (so every full block is reusable)."""
    return [tag * 1000 + i for i in range(num_blocks * size)] + [7]


# -- the policies alone -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_set_it_is_given(name: str) -> None:
    policy = make_policy(name, 10)
    for block_id in range(5):
        policy.insert(block_id, BlockUse(hits=block_id % 2, depth=0))
    policy.remove(3)
    assert len(policy) == 4 and 3 not in policy and 4 in policy
    assert sorted(policy.order()) == [0, 1, 2, 4]
    victims = [policy.pop_victim() for _ in range(4)]
    assert sorted(victims) == [0, 1, 2, 4]
    with pytest.raises(LookupError):
        policy.pop_victim()


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="frequency, lru, reuse, slru"):
        make_policy("fifo", 10)


def test_lru_evicts_in_release_order() -> None:
    policy = LRUPolicy()
    for block_id in (4, 2, 9):
        policy.insert(block_id, BlockUse(hits=5, depth=0))
    assert [policy.pop_victim() for _ in range(3)] == [4, 2, 9]


def test_slru_evicts_one_time_blocks_before_reused_ones_and_demotes_overflow() -> None:
    policy = SLRUPolicy(6, protected_share=0.5)
    policy.insert(1, BlockUse(hits=3, depth=0))  # reused: protected
    for block_id in (10, 11, 12):
        policy.insert(block_id, BlockUse(hits=0, depth=0))  # a scan: probation
    assert [policy.pop_victim() for _ in range(3)] == [10, 11, 12]
    assert policy.pop_victim() == 1
    for block_id in (1, 2, 3, 4):
        policy.insert(block_id, BlockUse(hits=1, depth=0))
    # protected is held to half of the 6-block pool: the oldest reused block is demoted, evicted first
    assert policy.order() == (1, 2, 3, 4)
    assert policy.pop_victim() == 1


def test_frequency_evicts_cold_then_fewest_hits_then_oldest_and_ages_old_hits_out() -> None:
    policy = FrequencyPolicy(max_hits=4)
    policy.insert(1, BlockUse(hits=2, depth=0))
    policy.insert(2, BlockUse(hits=0, depth=0))
    policy.insert(3, BlockUse(hits=0, depth=5))
    policy.insert(4, BlockUse(hits=0, depth=0, cold=True))
    assert policy.pop_victim() == 4  # a one-off prompt's block goes first
    assert policy.pop_victim() == 2  # then no hits, the older release first
    assert policy.pop_victim() == 3
    # fresh blocks enter at clock + 1: evicting them raises the clock until block 1 (clock 0 + 3) goes
    evicted = []
    for block_id in range(100, 110):
        policy.insert(block_id, BlockUse(hits=0, depth=0))
        evicted.append(policy.pop_victim())
        if evicted[-1] == 1:
            break
    assert evicted[-1] == 1 and 1 < len(evicted) < 10
    # hits count up to max_hits: a block hit 1,000 times is kept no longer than one hit 4 times
    while len(policy):
        policy.pop_victim()
    policy.insert(7, BlockUse(hits=1000, depth=0))
    policy.insert(8, BlockUse(hits=4, depth=0))
    assert [policy.pop_victim(), policy.pop_victim()] == [7, 8]  # equal priorities: the older first


# -- policies in the block manager ----------------------------------------------------------------


def _scan_then_reuse(policy: str) -> int:
    """A hot 3-block prefix served twice, then a scan of unique prompts that fills the pool, then
    the hot prefix again: how many of its tokens are still cached."""
    bm = BlockManager(num_blocks=12, block_size=2, policy=policy)
    hot = prompt(1, 3)
    run(bm, "hot-0", hot)
    run(bm, "hot-1", hot)
    for i in range(6):
        run(bm, f"scan-{i}", prompt(100 + i, 2))
    return run(bm, "hot-2", hot)


def test_a_scan_flushes_the_hot_prefix_under_lru_but_not_under_slru_or_frequency() -> None:
    assert _scan_then_reuse("lru") < 6
    assert _scan_then_reuse("slru") == 6
    assert _scan_then_reuse("frequency") == 6


def test_a_one_off_prompt_goes_before_a_prompt_that_shared_a_prefix_under_frequency() -> None:
    bm = BlockManager(num_blocks=9, block_size=2, policy="frequency")
    run(bm, "system", prompt(1, 2))  # cold: nothing was cached
    session = prompt(1, 2)[:-1] + [50, 51, 52, 53, 7]  # shares the system prompt's 2 blocks
    run(bm, "turn", session)
    run(bm, "one-off", prompt(9, 2))  # cold again
    run(bm, "pressure", prompt(8, 2))  # 3 blocks: the 1 free one, then 2 evictions
    assert run(bm, "turn-again", session) == 8  # the session's blocks stayed; the one-off's went


def test_set_policy_keeps_every_cached_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    run(bm, "a", prompt(1, 2))
    run(bm, "b", prompt(2, 2))
    before = set(bm.snapshot().cached_block_ids)
    bm.set_policy("frequency")
    assert bm.policy == "frequency" and bm.statistics().policy == "frequency"
    assert set(bm.snapshot().cached_block_ids) == before
    assert run(bm, "a2", prompt(1, 2)) == 4


# -- pins ------------------------------------------------------------------------------------------


def test_a_pinned_prefix_survives_pressure_and_expires_on_its_ttl() -> None:
    clock = FakeClock()
    bm = BlockManager(num_blocks=10, block_size=2, max_pinned_blocks=3, clock=clock)
    system = prompt(1, 3)
    bm.allocate("s", system)
    bm.mark_computed("s", system)
    assert bm.pin("s", ttl_s=60.0) == 3
    bm.free("s")
    stats = bm.statistics()
    assert (stats.num_pinned_blocks, stats.num_pins, stats.num_cached_blocks) == (3, 1, 3)
    for i in range(6):  # far more than the 7 unpinned blocks
        run(bm, f"scan-{i}", prompt(100 + i, 3))
    assert run(bm, "s2", system) == 6
    clock.now = 61.0
    for i in range(6):
        run(bm, f"scan2-{i}", prompt(200 + i, 3))
    assert bm.statistics().num_pins_expired == 1 and bm.statistics().num_pinned_blocks == 0
    assert run(bm, "s3", system) == 0


def test_pins_never_take_more_than_their_share_and_the_soonest_to_end_gives_way() -> None:
    clock = FakeClock()
    bm = BlockManager(num_blocks=12, block_size=2, max_pinned_blocks=4, clock=clock)
    for tag, ttl in ((1, 10.0), (2, 100.0)):
        tokens = prompt(tag, 2)
        bm.allocate(f"p{tag}", tokens)
        bm.mark_computed(f"p{tag}", tokens)
        assert bm.pin(f"p{tag}", ttl_s=ttl, key=f"k{tag}") == 2
        bm.free(f"p{tag}")
    tokens = prompt(3, 3)
    bm.allocate("p3", tokens)
    bm.mark_computed("p3", tokens)
    # 3 more blocks do not fit beside 4: the pin ending first (k1) is displaced, then p3 is cut to 2
    assert bm.pin("p3", ttl_s=50.0, key="k3") == 2
    assert sorted(bm.pinned_keys()) == ["k2", "k3"]
    stats = bm.statistics()
    assert stats.num_pinned_blocks == 4 and stats.num_pins_displaced == 1
    assert bm.unpin("k2") and not bm.unpin("k2")
    bm.free("p3")
    assert bm.statistics().num_pinned_blocks == 2


def test_pinning_the_same_key_renews_it_and_reset_drops_every_pin() -> None:
    clock = FakeClock()
    bm = BlockManager(num_blocks=8, block_size=2, clock=clock)
    tokens = prompt(1, 2)
    for i, now in enumerate((0.0, 50.0)):
        clock.now = now
        bm.allocate(f"r{i}", tokens)
        bm.mark_computed(f"r{i}", tokens)
        bm.pin(f"r{i}", ttl_s=60.0, key="session")
        bm.free(f"r{i}")
    clock.now = 100.0  # past the first pin's end, before the renewed one's
    assert bm.expire_pins() == 0 and bm.pinned_keys() == ["session"]
    bm.reset_prefix_cache()
    assert bm.statistics().num_pins == 0 and bm.statistics().num_pinned_blocks == 0
    assert bm.statistics().num_free_blocks == 8


def test_no_pins_when_the_share_is_zero() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, max_pinned_blocks=0)
    tokens = prompt(1, 2)
    bm.allocate("a", tokens)
    bm.mark_computed("a", tokens)
    assert bm.pin("a", ttl_s=5.0) == 0


# -- the second tier (bookkeeping) ---------------------------------------------------------------


class DictTier:
    """A tier store over a fake KV store (slot contents by block), as the property test uses."""

    medium = "TEST"

    def __init__(self, kv: dict[int, object], num_slots: int) -> None:
        self.kv, self.num_slots, self.slots = kv, num_slots, {}

    def save(self, block_id: int, slot: int) -> None:
        self.slots[slot] = self.kv.get(block_id)

    def load(self, slot: int, block_id: int) -> None:
        self.kv[block_id] = self.slots[slot]


def test_an_evicted_block_comes_back_from_the_tier_with_its_content() -> None:
    kv: dict[int, object] = {}
    bus = KVEventBus(buffer_size=100)
    bm = BlockManager(num_blocks=4, block_size=2, tier=DictTier(kv, 8), event_bus=bus)
    first = prompt(1, 2)
    table = bm.allocate("a", first).block_table
    for index, block_id in enumerate(table):
        kv[block_id] = ("a", index)
    bm.mark_computed("a", first)
    bm.free("a")
    run(bm, "b", prompt(2, 3))  # needs all 4 blocks: both of a's cached blocks are evicted to the tier
    stats = bm.statistics()
    assert stats.num_tier_saves == 2 and stats.num_tier_blocks == 2
    allocation = bm.allocate("a2", first)
    assert allocation.num_cached_tokens == 4
    assert [kv[b] for b in allocation.block_table[:2]] == [("a", 0), ("a", 1)]
    stats = bm.statistics()
    assert stats.num_tier_loads == 2 and stats.num_tier_hit_tokens == 4
    events = bus.drain()
    assert any(isinstance(e, BlockStored) and e.medium == "TEST" for e in events)
    assert any(isinstance(e, BlockStored) and e.medium is None and len(e.block_hashes) == 2 for e in events[-2:])
    assert not any(isinstance(e, BlockRemoved) and e.medium == "TEST" for e in events)


# -- the engine ------------------------------------------------------------------------------------


def _greedy(engine, tokens: list[int], request_id: str, *, retention: Retention | None = None) -> list[int]:
    seq = engine.add_request(request_id, tokens, SamplingParams(max_tokens=4, temperature=0.0), retention=retention)
    while not seq.is_finished:
        engine.step()
    return seq.output_token_ids


def _pressure(engine, rounds: int = 6) -> None:
    for i in range(rounds):
        _greedy(engine, [40 + (i * 7 + j) % 50 for j in range(60)], f"filler-{i}")


@pytest.mark.parametrize("tier_cls", [HostTier, Int8Tier])
def test_tier_round_trip_returns_the_kv(tier_cls) -> None:
    engine = make_engine(num_kv_blocks=8, block_size=4)
    kv = engine.runner.kv_cache
    kv.copy_(torch.randn_like(kv))
    tier = tier_cls(kv, 2)
    before = kv[:, :, 3].clone()
    tier.save(3, 1)
    kv[:, :, 3] = 0
    tier.load(1, 3)
    if tier_cls is HostTier:
        assert torch.equal(kv[:, :, 3], before)
    else:
        error = (kv[:, :, 3].float() - before.float()).abs().max() / before.float().abs().max()
        assert error < 0.01


def test_engine_with_a_host_tier_serves_an_evicted_prefix_from_the_tier_with_the_same_output() -> None:
    shared = [10 + i % 30 for i in range(48)]
    plain = make_engine(num_kv_blocks=20, block_size=4)
    expected = _greedy(plain, shared, "a")
    tiered = make_engine(num_kv_blocks=20, block_size=4, kv_cache=KVCacheOptions(tier="host", tier_blocks=64))
    assert _greedy(tiered, shared, "a") == expected
    _pressure(tiered, rounds=3)  # evicts every cached block, within the tier's 64 slots
    seq = tiered.add_request("again", shared, SamplingParams(max_tokens=4, temperature=0.0))
    while not seq.is_finished:
        tiered.step()
    assert seq.output_token_ids == expected
    stats = tiered.block_manager.statistics()
    assert seq.num_cached_prompt_tokens > 0 and stats.num_tier_hit_tokens > 0


def test_engine_retention_pins_the_prefix_through_pressure() -> None:
    system = [10 + i % 30 for i in range(40)]
    for retention, expect_hit in ((None, False), (Retention(ttl_s=600.0, num_tokens=32), True)):
        engine = make_engine(num_kv_blocks=24, block_size=4, kv_cache=KVCacheOptions(max_pinned_share=0.5))
        _greedy(engine, system + [1, 2, 3], "first", retention=retention)
        _pressure(engine)
        seq = engine.add_request("again", system + [4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0))
        while not seq.is_finished:
            engine.step()
        assert (seq.num_cached_prompt_tokens == 32) == expect_hit, retention


def test_configure_kv_cache_switches_the_policy_while_serving() -> None:
    engine = make_engine(num_kv_blocks=24, block_size=4)
    _greedy(engine, list(range(10, 30)), "a")
    engine.configure_kv_cache(KVCacheOptions(policy="slru", max_pinned_share=0.0))
    assert engine.block_manager.policy == "slru" and engine.block_manager.max_pinned_blocks == 0
    assert _greedy(engine, list(range(10, 30)), "b")


def test_request_log_rows_replay_the_engine_hits(tmp_path) -> None:
    import json

    log = tmp_path / "log" / "requests.jsonl"
    engine = make_engine(num_kv_blocks=40, block_size=4, kv_cache=KVCacheOptions(request_log=str(log)))
    first = list(range(10, 30))
    output = _greedy(engine, first, "a")
    second = first + output + [50, 51]  # the next turn: the first's prompt and answer, then more
    _greedy(engine, second, "b")
    engine.close()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["input_length"] for r in rows] == [20, 26]
    assert rows[0]["block_size"] == 4 and len(rows[0]["hash_ids"]) == 5 and rows[0]["output_length"] == 4
    assert rows[1]["hash_ids"][:5] == rows[0]["hash_ids"]  # the shared full blocks, same ids
    # the 5 full blocks, then the first 3 slots of the first's tail block (its 3 computed output
    # tokens), copied: 23
    assert rows[1]["cached_tokens"] == 23
    # 23 computed tokens (the last output token's KV is never written): 5 full blocks
    assert rows[0]["sequence_hash_ids"] == rows[0]["hash_ids"]
    assert rows[0]["finish_ms"] >= rows[0]["timestamp"]
    assert set(rows[0]) == {"timestamp", "finish_ms", "input_length", "output_length", "block_size", "hash_ids",
                            "sequence_hash_ids", "cached_tokens", "pin_tokens", "pin_ttl_s", "final"}  # no text, no token ids


def _stopped(engine, tokens: list[int], request_id: str, retention: Retention, stop_token: int):
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_token,))
    seq = engine.add_request(request_id, tokens, params, retention=retention)
    while not seq.is_finished:
        engine.step()
    return seq


def test_an_answer_without_a_tool_call_frees_its_blocks_as_final_and_its_log_row_says_so(tmp_path) -> None:
    import json

    log = tmp_path / "requests.jsonl"
    engine = make_engine(num_kv_blocks=40, block_size=4, kv_cache=KVCacheOptions(policy="reuse", request_log=str(log)))
    tokens = list(range(10, 30))
    stop_token = _greedy(engine, tokens, "learn")[2]  # ends at max_tokens: never final
    answer = _stopped(engine, tokens, "answer", Retention(0.0, final_unless=("<tool_call>",)), stop_token)
    assert answer.output_text and "<tool_call>" not in answer.output_text
    # the same output, where it holds what a tool call starts with: the session goes on
    _stopped(engine, tokens, "call", Retention(0.0, final_unless=(answer.output_text,)), stop_token)
    _greedy(engine, tokens, "length", retention=Retention(0.0, final_unless=("<tool_call>",)))  # cut short
    engine.close()
    assert engine.block_manager.statistics().num_final_frees == 1
    assert [json.loads(line)["final"] for line in log.read_text().splitlines()] == [False, True, False, False]
