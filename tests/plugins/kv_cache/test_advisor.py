"""The KV cache advisor: trace readers, the replay on traces whose answer is known, the
recommendation, ``loopstack kv advise`` and the ``kv`` bench."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loopstack.bench.runner import run_bench
from loopstack.bench.workload import BenchOptions
from loopstack.cli.main import main
from loopstack.engine.request_log import RequestLog
from loopstack.plugins.cache_routing.bench.trace import AGENT_TRACE, MOONCAKE_TRACE
from loopstack.plugins.kv_cache.advisor.replay import ReplayConfig, ReplayResult, ServiceModel, replay
from loopstack.plugins.kv_cache.advisor.report import (
    Advice,
    default_capacities,
    format_advice,
    parse_tokens,
    recommend,
)
from loopstack.plugins.kv_cache.advisor.traces import (
    AdvisorRequest,
    TraceFormatError,
    load_requests,
    load_traces,
)
from loopstack.plugins.kv_cache.advisor.units import infinite_cache
from loopstack.plugins.kv_cache.bench.variants import policy_spec
from loopstack.plugins.kv_cache.bench.workload import KVWorkload, ScanSettings, with_scans
from tests.support import SHARED_DATA

G = 512  # the Mooncake granularity


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mooncake_rows(prompts: list[tuple[float, int, list[int]]], output_length: int = 1) -> list[dict]:
    return [{"timestamp": at * 1000, "input_length": length, "output_length": output_length, "hash_ids": ids}
            for at, length, ids in prompts]


def request(at: float, ids: list[int], length: int | None = None, *, finish: float | None = None,
            output_length: int = 1, **fields) -> AdvisorRequest:
    return AdvisorRequest(at, finish, length or len(ids) * G, output_length, G, tuple(ids), **fields)


def agent_rows() -> list[dict]:
    rows = []
    for session, created in (("a", 100), ("b", 101)):
        for turn in range(3):
            rows.append({"instance_id": session, "turn": turn, "prompt_tokens": 600 + 600 * turn,
                         "completion_tokens": 50, "created": created + 10 * turn})
    return rows


# -- trace readers ---------------------------------------------------------------------------------


def test_a_mooncake_trace_reads_with_times_from_the_first_arrival(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", mooncake_rows([(5.0, 1000, [0, 1]), (7.5, 600, [0, 2])]))
    first, second = load_requests(path)
    assert (first.arrival_s, second.arrival_s) == (0.0, 2.5)
    assert first == AdvisorRequest(0.0, None, 1000, 1, G, (0, 1))


def test_a_server_request_log_reads_with_finish_times_sequences_and_pins(tmp_path):
    log = RequestLog(tmp_path / "requests.jsonl", block_size=4)
    log.record(arrival_s=1000.0, finish_s=1001.5, prompt_token_ids=list(range(10)), computed_token_ids=list(range(16)),
               salt=b"", cached_tokens=0, pin_tokens=8, pin_ttl_s=30.0, final=True)
    log.close()
    (row,) = load_requests(log.path)
    assert row.final
    assert (row.arrival_s, row.finish_s, row.block_size, row.input_length, row.output_length) == (0.0, 1.5, 4, 10, 7)
    assert len(row.hash_ids) == 3 and len(row.sequence_hash_ids or ()) == 4
    assert row.hash_ids[:2] == row.sequence_hash_ids[:2]  # full prompt blocks are the sequence's first blocks
    assert (row.pin_tokens, row.pin_ttl_s, row.cached_tokens) == (8, 30.0, 0)


def test_agent_trajectories_read_as_growing_chains_behind_one_shared_block(tmp_path):
    path = write_jsonl(tmp_path / "per_turn_usage.jsonl", agent_rows())
    requests = load_requests(path)
    assert len(requests) == 6 and requests[0].arrival_s == 0.0
    assert len({r.hash_ids[0] for r in requests}) == 1
    a_turns = [r for r in requests if r.hash_ids[1] == requests[0].hash_ids[1]]
    assert [len(r.hash_ids) for r in a_turns] == [2, 3, 4]
    assert a_turns[2].hash_ids[:3] == a_turns[1].hash_ids


def test_the_agents_submit_command_marks_the_request_that_ended_its_session(tmp_path):
    rows = agent_rows()
    rows[2]["command"] = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"
    rows[4]["command"] = "ls -R"
    requests = load_requests(write_jsonl(tmp_path / "per_turn_usage.jsonl", rows))
    assert [r.final for r in requests] == [False, False, False, False, True, False]  # a's last turn, at 120 s


@pytest.mark.parametrize(("row", "field"), [
    ({"timestamp": 0, "input_length": "many", "output_length": 1, "hash_ids": [0]}, "input_length"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1}, "hash_ids"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, -1]}, "hash_ids"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0], "block_size": 0}, "block_size"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0], "block_size": 16, "final": "yes"}, "final"),
])
def test_a_bad_row_names_the_file_the_line_and_the_field(tmp_path, row, field):
    good = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}
    if "block_size" in row:
        good["block_size"] = 16
    path = write_jsonl(tmp_path / "t.jsonl", [good, row])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:2: field '{field}'"):
        load_requests(path)


def test_a_bad_agent_row_names_its_field(tmp_path):
    rows = agent_rows()
    del rows[3]["prompt_tokens"]
    path = write_jsonl(tmp_path / "per_turn_usage.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"per_turn_usage\.jsonl:4: field 'prompt_tokens': missing"):
        load_requests(path)


def test_an_unknown_format_says_what_it_expected(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "hi"}])
    with pytest.raises(TraceFormatError, match=r"x\.jsonl:1: unknown trace format"):
        load_requests(path)


def test_a_last_line_a_crash_cut_short_is_skipped(tmp_path):
    path = write_jsonl(tmp_path / "log.jsonl", mooncake_rows([(0.0, 10, [0])]))
    path.write_text(path.read_text() + '{"timestamp": 1, "input_le')
    assert len(load_requests(path)) == 1


def test_two_mooncake_files_never_share_blocks_by_accident(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", mooncake_rows([(0.0, 1024, [0, 1])]))
    b = write_jsonl(tmp_path / "b.jsonl", mooncake_rows([(1.0, 1024, [0, 1])]))
    first, second = load_traces([a, b])
    assert not set(first.hash_ids) & set(second.hash_ids)


# -- replay ----------------------------------------------------------------------------------------


def test_a_repeated_prompt_hits_all_but_its_last_block():
    for length in (4 * G, 4 * G - 100):  # the last block full, or partial
        result = replay([request(0.0, [0, 1, 2, 3], length), request(100.0, [0, 1, 2, 3], length)],
                        ReplayConfig(G, 64 * G))
        assert result.num_hit_tokens == 3 * G
        assert result.hit_rate == 3 * G / (2 * length)


@pytest.mark.parametrize(("block_size", "hit_tokens"), [(G, 3 * G), (2 * G, 2 * G), (4 * G, 0), (G // 2, 3 * G)])
def test_block_sizes_other_than_the_traces_map_to_units(block_size, hit_tokens):
    length = 4 * G + 100  # 5 trace blocks, the last partial; the two prompts differ from the fourth on
    trace = [request(0.0, [0, 1, 2, 3, 4], length), request(100.0, [0, 1, 2, 8, 9], length)]
    assert replay(trace, ReplayConfig(block_size, 64 * G)).num_hit_tokens == hit_tokens


def test_reuse_lets_a_session_that_ended_go_before_one_between_turns():
    between = [0, 4, 5, 6]  # a session whose next turn comes after the others
    requests = [request(0.0, between), request(10.0, [0, 1, 2, 3], final=True), request(20.0, [7, 8, 9]),
                request(30.0, [*between, 10])]
    told, deaf = (replay(requests, ReplayConfig(G, 7 * G, "reuse", honor_final=honor)) for honor in (True, False))
    assert told.num_hit_tokens == 5 * G  # the shared block, then the whole returning turn
    assert deaf.num_hit_tokens == 2 * G  # blind, the newer session stayed and the returning one was evicted
    assert replay(requests, ReplayConfig(G, 7 * G, "lru")).num_hit_tokens == 2 * G  # lru ignores the hint


def test_a_capacity_too_small_thrashes_under_lru():
    prompts = [[10 * p + i for i in range(4)] for p in range(3)]
    cyclic = [request(10.0 * n, prompts[n % 3]) for n in range(12)]
    assert replay(cyclic, ReplayConfig(G, 8 * G, "lru")).num_hit_tokens == 0  # each evicts the next one needed
    roomy = replay(cyclic, ReplayConfig(G, 12 * G, "lru"))
    assert roomy.num_hit_tokens == 9 * 3 * G
    assert roomy.num_evictions == 9  # only each prompt's own cached last block, for its private copy


def test_a_server_log_sequence_makes_the_next_turn_hit_its_output(tmp_path):
    log = RequestLog(tmp_path / "log.jsonl", block_size=4)
    turn_1 = list(range(10))
    computed = turn_1 + list(range(100, 106))  # 16 tokens: 4 full blocks, the output in the last two
    log.record(arrival_s=0.0, finish_s=1.0, prompt_token_ids=turn_1, computed_token_ids=computed, salt=b"", cached_tokens=0)
    turn_2 = [*computed, 106, 200, 201, 202, 203]
    log.record(arrival_s=2.0, finish_s=3.0, prompt_token_ids=turn_2, computed_token_ids=turn_2, salt=b"", cached_tokens=16)
    log.close()
    requests = load_requests(log.path)
    assert replay(requests, ReplayConfig(4, 1024)).num_hit_tokens == 16  # as the live engine served it
    without_sequences = [AdvisorRequest(r.arrival_s, r.finish_s, r.input_length, r.output_length, 4, r.hash_ids)
                         for r in requests]
    assert replay(without_sequences, ReplayConfig(4, 1024)).num_hit_tokens == 8  # turn 1's full prompt blocks only


def _pinned_then_scanned(*, ttl_s: float, scan_at: float, pin_tokens: int = 4 * G) -> ReplayResult:
    """A 4-block prompt pinned for ``ttl_s``, three 4-block scans from ``scan_at`` on (the cache holds
    8 blocks, pins at most 4), then the prompt again."""
    system = [0, 1, 2, 3]
    scans = [request(scan_at + 5 * n, [100 + 10 * n + i for i in range(4)], finish=scan_at + 5 * n + 1) for n in range(3)]
    trace = [request(0.0, system, finish=1.0, pin_tokens=pin_tokens, pin_ttl_s=ttl_s), *scans,
             request(scan_at + 100, system, finish=scan_at + 101)]
    return replay(trace, ReplayConfig(G, 8 * G, "lru", max_pinned_tokens=4 * G))


def test_a_pin_keeps_a_prefix_through_a_scan():
    pinned = _pinned_then_scanned(ttl_s=1000.0, scan_at=10.0)
    assert pinned.num_pins == 1 and pinned.num_hit_tokens == 3 * G and pinned.num_evictions > 0
    assert _pinned_then_scanned(ttl_s=1000.0, scan_at=10.0, pin_tokens=0).num_hit_tokens == 0


def test_a_pin_ends_on_its_ttl_in_trace_time():
    expired = _pinned_then_scanned(ttl_s=100.0, scan_at=200.0)  # the scans come after the TTL, in trace time
    assert expired.num_pins == 1 and expired.num_pins_expired == 1 and expired.num_hit_tokens == 0
    assert _pinned_then_scanned(ttl_s=400.0, scan_at=200.0).num_hit_tokens == 3 * G


def test_a_second_tier_serves_what_the_cache_evicted():
    prompt = [0, 1, 2, 3]
    trace = [request(0.0, prompt), request(10.0, [9, 8, 7, 6]), request(20.0, prompt)]
    assert replay(trace, ReplayConfig(G, 4 * G)).num_hit_tokens == 0
    tiered = replay(trace, ReplayConfig(G, 4 * G, tier_slots=16))
    assert tiered.num_hit_tokens == tiered.num_tier_hit_tokens == 3 * G


def test_a_prompt_larger_than_the_cache_is_skipped_and_counted():
    result = replay([request(0.0, list(range(10))), request(1.0, [0])], ReplayConfig(G, 4 * G))
    assert (result.num_skipped, result.num_requests) == (1, 1)


def test_modelled_time_queues_prefills_one_at_a_time():
    # two 16,000-token prompts at once: the second starts when the first's prefill ends (1 s at 16k tokens/s)
    trace = [request(0.0, list(range(32)), 16_000), request(0.0, list(range(100, 132)), 16_000)]
    result = replay(trace, ReplayConfig(G, 256 * G), service=ServiceModel(prefill_tokens_per_s=16_000.0))
    assert result.prefill_s == pytest.approx(2.0) and result.mean_queue_s == pytest.approx(0.5)


def test_the_never_evicting_bound_is_what_an_ample_cache_reaches():
    prompts = [[10 * p + i for i in range(4)] for p in range(3)]
    cyclic = [request(10.0 * n, prompts[n % 3]) for n in range(12)]
    bound = infinite_cache(cyclic, G)
    assert bound.hit_rate == replay(cyclic, ReplayConfig(G, 64 * G)).hit_rate
    assert bound.working_set_tokens == 12 * G


def test_policy_variants_replay_beside_the_engines():
    prompts = [[10 * p + i for i in range(4)] for p in range(3)]
    cyclic = [request(10.0 * n, prompts[n % 3]) for n in range(12)]
    for name in ("gd", "gdsf", "gdsf4", "gdsf2d", "slru50", "slru_evictable"):
        result = replay(cyclic, ReplayConfig(G, 12 * G, policy_spec(name)))
        assert result.config.policy_name == name and result.num_hit_tokens == 9 * 3 * G
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        policy_spec("nope")


def _rounds_until_evicted(policy, rounds: int = 50) -> int | None:
    """A block that served 5 hits, then a stream of fresh blocks, one victim per fresh block."""
    from loopstack.engine.eviction import BlockUse

    policy.insert(0, BlockUse(hits=5, depth=0))
    policy.insert(1, BlockUse(hits=0, depth=0))
    for n in range(rounds):
        if policy.pop_victim() == 0:
            return n
        policy.insert(n + 2, BlockUse(hits=0, depth=0))
    return None


def test_frequency_ages_out_a_hit_block_while_fresh_blocks_come_and_plain_greedy_dual_does_not():
    from loopstack.engine.eviction import FrequencyPolicy

    # the engine's frequency (GDSF, hits capped at 4): each fresh victim raises the clock by one
    assert _rounds_until_evicted(FrequencyPolicy(16)) == 4
    assert _rounds_until_evicted(policy_spec("gd")(16)) is None  # fresh blocks at the clock: it never rises


# -- recommendation --------------------------------------------------------------------------------


def fake(capacity: int, policy: str, saved: int, block_size: int = G) -> ReplayResult:
    return ReplayResult(ReplayConfig(block_size, capacity, policy), 10, 0, 1000, saved, 0, 1.0, 0, 0, 0, 0, 0)


def test_the_recommendation_is_the_smallest_capacity_within_95_percent_of_the_largest():
    results = [fake(1024, "lru", 500), fake(1024, "slru", 600), fake(2048, "lru", 950), fake(2048, "frequency", 960),
               fake(4096, "lru", 1000), fake(4096, "slru", 990)]
    advice = recommend(results)
    assert [(r.config.capacity_tokens, r.config.policy) for r in advice.best_per_capacity] == [
        (1024, "slru"), (2048, "frequency"), (4096, "lru")]
    assert advice.recommended is not None and advice.recommended.config.capacity_tokens == 2048
    assert recommend(results, share=0.97).recommended.config.capacity_tokens == 4096
    text = format_advice(advice)
    assert "recommended: 2k tokens (2,048), policy frequency" in text and "96.0% of what 4k saves" in text


def test_a_trace_without_reuse_recommends_the_smallest_capacity():
    advice = recommend([fake(1024, "lru", 0), fake(4096, "lru", 0)])
    assert advice.recommended.config.capacity_tokens == 1024
    assert "nothing in this trace is reused" in format_advice(advice)
    assert recommend([]) == Advice((), (), None, 0.95, {})


def test_default_capacities_are_powers_of_two_below_the_working_set():
    trace = [request(float(n), [1000 * n + i for i in range(64)]) for n in range(64)]  # 4096 blocks, none shared
    capacities = default_capacities(trace, (G, 2 * G))
    working_set = infinite_cache(trace, G).working_set_tokens
    assert all(c & (c - 1) == 0 and c % (2 * G) == 0 for c in capacities)
    assert capacities[-1] == working_set // 2 and len(capacities) == 6
    assert parse_tokens("512k") == 512 * 1024 and parse_tokens("2M") == 2 << 20
    with pytest.raises(ValueError, match="like 65536"):
        parse_tokens("lots")


# -- loopstack kv advise ---------------------------------------------------------------------------


def test_kv_advise_prints_the_grid_and_a_recommendation(tmp_path, capsys):
    rows = mooncake_rows([(float(n), 2048 + 100, [0, 1, 2, 3, 100 + n]) for n in range(20)])
    trace = write_jsonl(tmp_path / "trace.jsonl", rows)
    out = tmp_path / "advice.json"
    assert main(["kv", "advise", str(trace), "--capacities", "4k,16k", "--block-sizes", "512,1024",
                 "--policies", "lru,frequency", "--no-progress", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "20 requests, 512-token trace blocks" in printed and "recommended: 4k tokens" in printed
    data = json.loads(out.read_text())
    assert len(data["results"]) == 2 * 2 * 2
    assert data["recommended"]["config"]["capacity_tokens"] == 4096
    assert data["recommended"]["hit_rate"] == pytest.approx(19 * 4 * G / (20 * (4 * G + 100)))


def test_kv_advise_defaults_and_errors(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "trace.jsonl", mooncake_rows([(float(n), 1024, [0, n + 1]) for n in range(8)]))
    assert main(["kv", "advise", str(trace), "--no-progress", "--tier-slots", "8"]) == 0
    printed = capsys.readouterr().out
    assert "tier hits" in printed and "never-evicting cache at block size 512" in printed
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 5, "output_length": "x", "hash_ids": [1]}])
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1: field 'output_length'"):
        main(["kv", "advise", str(bad)])
    with pytest.raises(SystemExit, match="unknown policy 'mru'"):
        main(["kv", "advise", str(trace), "--policies", "mru"])


# -- the kv bench ----------------------------------------------------------------------------------


def synthetic_data(root: Path) -> Path:
    """A tiny Mooncake trace and agent trajectories in the shared-data layout."""
    conversations = []
    for c in range(30):
        ids = [0]
        for turn in range(3):
            ids = ids + [1000 * c + 10 * turn + i for i in range(3)]
            conversations.append((c * 3.0 + turn * 20.0, len(ids) * G - 50, list(ids)))
    write_jsonl(root / MOONCAKE_TRACE, mooncake_rows(sorted(conversations), output_length=20))
    sessions = [{"instance_id": f"s{s}", "turn": t, "prompt_tokens": 1500 + 700 * t, "completion_tokens": 40,
                 "created": 1000 + 7 * s + 5 * t} for s in range(20) for t in range(6)]
    write_jsonl(root / AGENT_TRACE, sessions)
    return root


def test_scans_interleave_unique_prompts_into_the_timeline():
    base = [request(float(t), [0, 1]) for t in range(0, 100, 10)]
    mixed = with_scans(base, ScanSettings(every_s=30.0, num_prompts=2, prompt_tokens=2048))
    scans = [r for r in mixed if r not in base]
    assert len(scans) == 6 and [r.arrival_s for r in mixed] == sorted(r.arrival_s for r in mixed)
    assert len({h for r in scans for h in r.hash_ids}) == sum(len(r.hash_ids) for r in scans)


def test_the_kv_bench_runs_quick_on_synthetic_traces(tmp_path, capsys):
    options = BenchOptions(quick=True, data_dir=synthetic_data(tmp_path), extra={
        "capacities": "4k", "scan_every_s": "20", "scan_prompts": "4", "scan_tokens": "2048", "variants": "gdsf"})
    result = asyncio.run(run_bench(KVWorkload(), [], options, progress=False))
    assert result.columns == ["lru", "slru", "frequency", "reuse"]
    for row in ("mooncake", "agent", "mix"):
        for metric in ("hit_rate", "saved_tokens", "prefill_s"):
            assert set(result.metrics[f"{metric}@{row}@4k"]) == {"lru", "slru", "frequency", "reuse"}
        assert 0 < result.metrics[f"hit_rate@{row}@4k"]["lru"] < 1
    goals = result.config["goals"]
    assert [g["row"] for g in goals] == ["agent", "mix", "mooncake"]
    printed = capsys.readouterr().out
    assert all(("PASS" if g["passed"] else "FAIL") + "  " + g["text"] in printed for g in goals)
    assert "variant gdsf: mooncake@4k" in printed and "agent@4k" in result.config["variants"]["gdsf"]


def test_the_kv_bench_says_what_is_missing(tmp_path):
    from loopstack.bench.workload import BenchOptionError

    with pytest.raises(BenchOptionError, match="mooncake_conversation_trace.jsonl"):
        asyncio.run(run_bench(KVWorkload(), [], BenchOptions(quick=True, data_dir=tmp_path), progress=False))
    with pytest.raises(BenchOptionError, match="unknown option"):
        asyncio.run(run_bench(KVWorkload(), [], BenchOptions(quick=True, data_dir=tmp_path, extra={"nope": "1"}),
                              progress=False))


@pytest.mark.needs_data
@pytest.mark.skipif(not (SHARED_DATA / MOONCAKE_TRACE).exists() or not (SHARED_DATA / AGENT_TRACE).exists(),
                    reason=f"needs {SHARED_DATA / MOONCAKE_TRACE} and {SHARED_DATA / AGENT_TRACE} (absent)")
def test_the_kv_bench_runs_quick_on_the_real_traces():
    result = asyncio.run(run_bench(KVWorkload(), [], BenchOptions(quick=True, data_dir=SHARED_DATA), progress=False))
    rows = result.config["rows"]
    assert rows["mooncake"]["requests"] == 2000 and rows["mix"]["requests"] > rows["agent"]["requests"] == 2000
    for row, spec in rows.items():
        for capacity in spec["capacities"]:
            hit_rates = result.metrics[f"hit_rate@{row}@{capacity}"]
            assert all(0 < rate <= spec["infinite_cache_hit_rate"] + 1e-9 for rate in hit_rates.values())
