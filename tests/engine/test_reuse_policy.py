"""The ``reuse`` eviction policy: predicted next use from each block's reuse interval (issue 23).

Each test builds an access pattern where Belady's choice is known, and checks the policy makes it;
a property test checks that the heaps evict in exactly the order the predictions define.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loopstack.engine.block_manager import BlockManager
from loopstack.engine.eviction import BlockUse, ReusePolicy
from tests.engine.test_kv_cache_management import prompt, run


def use(name: str, release: int, *, depth: int = 0, cold: bool = False, final: bool = False) -> BlockUse:
    return BlockUse(hits=0, depth=depth, cold=cold, block_hash=name.encode(), release=release, final=final)


def released(policy: ReusePolicy, block_id: int, name: str, *releases: int) -> None:
    """The block is released at each tick (taken back by a hit in between), and left evictable."""
    for index, tick in enumerate(releases):
        if index:
            policy.remove(block_id)
        policy.insert(block_id, use(name, tick))


def test_the_block_due_back_later_goes_first() -> None:
    policy = ReusePolicy(8)
    policy.insert(2, use("seldom", 1))
    policy.insert(1, use("often", 9))
    policy.remove(1)  # both hit
    policy.remove(2)
    policy.insert(1, use("often", 11))  # interval 2: back at 13
    policy.insert(2, use("seldom", 11))  # interval 10: back at 21
    assert policy.order() == (2, 1)
    assert [policy.pop_victim(), policy.pop_victim()] == [2, 1]


def test_an_overdue_block_goes_before_one_still_due() -> None:
    policy = ReusePolicy(8)
    released(policy, 1, "finished", 1, 3)  # interval 2: due at 5, never came
    released(policy, 2, "slow", 10, 20)  # interval 10: due at 30
    # at tick 20 "finished" has been away 17 ticks: predicted back at 37, after "slow" (30)
    assert [policy.pop_victim(), policy.pop_victim()] == [1, 2]


def test_a_cold_one_off_goes_first_and_chains_go_from_the_leaves_in() -> None:
    policy = ReusePolicy(8)
    released(policy, 1, "hot", 1, 2)
    policy.insert(2, use("doc-0", 3, depth=0, cold=True))
    policy.insert(3, use("doc-1", 3, depth=1, cold=True))
    policy.insert(4, use("warm", 3))  # first seen, but its prompt found something cached
    assert policy.order()[:2] == (3, 2)
    assert [policy.pop_victim() for _ in range(4)] == [3, 2, 4, 1]


def test_ghost_hits_move_the_first_seen_offset() -> None:
    policy = ReusePolicy(8)
    released(policy, 1, "a", 1, 2)  # has an interval
    assert policy.pop_victim() == 1
    policy.insert(1, use("a", 3))  # computed again: a miss on a block evicted with an interval
    assert policy.offset == 1.0  # first-seen blocks now go a tick sooner
    policy.insert(2, use("b", 4))  # first seen
    assert policy.pop_victim() == 2
    policy.insert(2, use("b", 5))  # a miss on a first-seen block
    assert policy.offset == 0.0  # back: first-seen blocks wait longer again (never below 0)
    assert policy.ghost_hits == {"first_seen": 1, "with_interval": 1, "final": 0}


def test_blocks_of_a_session_that_ended_go_before_every_other_oldest_first() -> None:
    policy = ReusePolicy(8)
    policy.insert(1, use("scan", 1, cold=True))  # a one-off
    released(policy, 2, "done-0", 1, 2)  # an ended session's blocks, with intervals ...
    released(policy, 3, "done-1", 1, 2)
    policy.remove(2)
    policy.remove(3)
    policy.insert(3, use("done-1", 5, depth=1, final=True))  # ... released by its last request, tail first
    policy.insert(2, use("done-0", 5, depth=0, final=True))
    policy.insert(4, use("other-done", 6, final=True))
    released(policy, 5, "live", 1, 5)  # a session between turns
    assert policy.order() == (3, 2, 4, 1, 5)
    assert [policy.pop_victim() for _ in range(5)] == [3, 2, 4, 1, 5]


def test_a_block_an_ended_session_shares_with_a_live_one_is_predicted_again_when_the_live_one_releases_it() -> None:
    policy = ReusePolicy(8)
    policy.insert(1, use("system", 1, final=True))  # the shared system prompt, last released by a final request
    policy.remove(1)  # the next session hits it
    policy.insert(1, use("system", 2))  # and releases it: due again, by its interval
    policy.insert(2, use("done", 2, final=True))
    assert [policy.pop_victim(), policy.pop_victim()] == [2, 1]


def test_a_session_that_comes_back_after_its_final_answer_is_counted_and_leaves_the_offset() -> None:
    policy = ReusePolicy(8)
    policy.insert(1, use("a", 1, final=True))
    assert policy.pop_victim() == 1
    policy.insert(1, use("a", 3))  # computed again: the hint was wrong (a user's follow-up)
    assert policy.ghost_hits == {"first_seen": 0, "with_interval": 0, "final": 1}
    assert policy.offset == 0.0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "final", "remove", "pop", "tick"]), st.integers(0, 7), st.integers(0, 3),
            st.booleans(),
        ),
        max_size=80,
    )
)
def test_the_heaps_evict_in_the_order_the_predictions_define(ops: list[tuple[str, int, int, bool]]) -> None:
    policy = ReusePolicy(8)
    tick = 0
    for op, block_id, depth, cold in ops:
        if op == "tick":
            tick += 1 + depth
        elif op in ("insert", "final") and block_id not in policy:
            policy.insert(block_id, use(f"h{block_id}", tick, depth=depth, cold=cold, final=op == "final"))
        elif op == "remove" and block_id in policy:
            policy.remove(block_id)
        elif op == "pop" and len(policy):
            expected = policy.order()[0]
            assert policy.pop_victim() == expected
    while len(policy):
        expected = policy.order()[0]
        assert policy.pop_victim() == expected


def _sessions_taking_turns(policy: str) -> int:
    """Four sessions of 3 full blocks take 6 turns each, in order, through a 10-block pool (each turn
    needs 4): cached tokens over all turns but the first round (at most 4 x 5 x 6 = 120)."""
    bm = BlockManager(num_blocks=10, block_size=2, policy=policy)
    hits = 0
    for turn in range(6):
        for session in range(4):
            cached = run(bm, f"s{session}-t{turn}", prompt(session + 1, 3))
            hits += cached if turn else 0
    return hits


def test_sessions_taking_turns_through_a_small_cache_hit_under_reuse_and_not_under_lru() -> None:
    assert _sessions_taking_turns("lru") == 0  # LRU evicts the session that comes next, every time
    assert _sessions_taking_turns("frequency") == 0
    assert _sessions_taking_turns("reuse") >= 60  # keeping what comes back soonest, as Belady would
