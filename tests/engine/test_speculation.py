"""Speculative decoding in the engine step: lossless, batched, rolled back, grammar-safe."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from loopstack.engine.acceptance import verify
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.speculation import Proposal, SpeculationSpec
from loopstack.engine.speculator import best_k, gain
from loopstack.engine.step_cost import DEFAULT_STEP_COST
from loopstack.plugins.spec_decode.config import SpecDecodeConfig
from loopstack.plugins.spec_decode.plugin import build_spec
from tests.engine.support import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class Oracle:
    """Proposes the plain run's continuation, spoiled now and then: accept and reject paths both run."""

    plain: dict[str, list[int]] = {}

    def __init__(self, context) -> None:
        self.rng = random.Random(0)
        self.finished: list[str] = []

    def propose(self, seqs, max_tokens):
        out = []
        for seq, limit in zip(seqs, max_tokens):
            n = len(seq.output_token_ids)
            draft = list(self.plain[seq.request_id][n : n + limit])
            if draft and self.rng.random() < 0.5:
                draft[-1] = (draft[-1] + 1) % 256
            out.append(Proposal(draft))
        return out

    def finish(self, seq) -> None:
        self.finished.append(seq.request_id)


def oracle_spec(**overrides) -> SpeculationSpec:
    return SpeculationSpec(Oracle, "oracle", **{"num_speculative_tokens": 4, **overrides})


def plain_outputs(params=GREEDY) -> dict[str, list[int]]:
    return {str(i): s.output_token_ids for i, s in enumerate(make_engine().generate(PROMPTS, params))}


def run(engine, prompts, params=GREEDY, spec=None, ids=None):
    seqs = [engine.add_request(ids[i] if ids else str(i), p, params, speculation=spec) for i, p in enumerate(prompts)]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return seqs


def test_greedy_output_is_plain_greedy_in_a_mixed_batch_and_every_block_comes_back():
    Oracle.plain = plain_outputs()
    engine = make_engine()
    free = engine.block_manager.statistics().num_free_blocks
    # one plain request, two speculating ones, all prefilling in the first step
    plain = engine.add_request("0", PROMPTS[0], GREEDY)
    spec = [engine.add_request(str(i), PROMPTS[i], GREEDY, speculation=oracle_spec()) for i in (1, 2)]
    while not all(s.is_finished for s in [plain, *spec]):
        engine.step()
    for seq in [plain, *spec]:
        assert seq.output_token_ids == Oracle.plain[seq.request_id]
    stats = engine.speculator.statistics
    assert 0 < stats.num_accepted < stats.num_proposed and stats.tokens_per_forward > 1
    engine.block_manager.reset_prefix_cache()
    assert engine.block_manager.statistics().num_free_blocks == free
    assert engine.speculator.is_idle and sorted(engine.speculator.proposers["oracle"].finished) == ["1", "2"]


def test_stop_strings_max_tokens_and_logprobs_are_as_without_speculation():
    params = SamplingParams(temperature=0.0, max_tokens=17, logprobs=2, stop=("\x13",))
    Oracle.plain = plain_outputs(params)
    reference = make_engine().generate(PROMPTS, params)
    seqs = run(make_engine(), PROMPTS, params, oracle_spec(num_speculative_tokens=6))
    for seq, ref in zip(seqs, reference):
        assert seq.output_token_ids == ref.output_token_ids and seq.output_text == ref.output_text
        assert seq.finish_reason == ref.finish_reason
        assert [round(x, 4) for x in seq.logprobs] == [round(x, 4) for x in ref.logprobs]
        assert [[t for t, _ in top] for top in seq.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]


def test_an_aborted_speculating_request_frees_its_blocks():
    Oracle.plain = plain_outputs()
    engine = make_engine()
    free = engine.block_manager.statistics().num_free_blocks
    engine.add_request("2", PROMPTS[2], GREEDY, speculation=oracle_spec())
    for _ in range(4):
        engine.step()
    assert engine.speculator.statistics.num_verifies > 0
    engine.abort("2")
    engine.block_manager.reset_prefix_cache()
    assert engine.block_manager.statistics().num_free_blocks == free and engine.speculator.is_idle


def test_speculation_is_off_above_the_batch_size_and_counts_it():
    Oracle.plain = plain_outputs()
    engine = make_engine()
    seqs = run(engine, PROMPTS[:2], spec=oracle_spec(max_batch_size=1))
    stats = engine.speculator.statistics
    assert stats.num_proposed == 0 and stats.num_off_steps > 0
    assert [s.output_token_ids for s in seqs] == [Oracle.plain["0"], Oracle.plain["1"]]


@pytest.mark.parametrize("proposer", ["suffix", "ngram"])
def test_model_free_proposers_keep_greedy_output_and_speed_up_repetitive_text(proposer):
    prompts = [[5, 6, 7, 8, 9] * 8, list(range(30, 70)) * 2]
    reference = make_engine().generate(prompts, GREEDY)
    engine = make_engine()
    seqs = run(engine, prompts, spec=build_spec(SpecDecodeConfig(proposer=proposer)))
    assert [s.output_token_ids for s in seqs] == [r.output_token_ids for r in reference]
    assert engine.speculator.statistics.num_accepted > 0


def test_grammar_constrained_speculation_yields_valid_output():
    grammar = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"], "additionalProperties": False}}
    params = SamplingParams(temperature=0.0, max_tokens=40, grammar=grammar)

    class JsonGuess:  # proposes JSON that is partly valid, partly not, and past the end
        def __init__(self, context):
            pass

        def propose(self, seqs, limits):
            return [Proposal(list(b'{"a": 12}}}')[len(s.output_token_ids):][:k] or list(b"xx")) for s, k in zip(seqs, limits)]

        def finish(self, seq):
            pass

    reference = make_engine().generate([PROMPTS[1]], params)[0]
    engine = make_engine()
    [seq] = run(engine, [PROMPTS[1]], params, SpeculationSpec(JsonGuess, "json", num_speculative_tokens=8))
    assert seq.output_text == reference.output_text
    # a random-weight model writes digits until max_tokens: valid so far, and valid JSON when it stops
    assert re.fullmatch(r'\{"a": ?-?[0-9]*(\})?', seq.output_text), seq.output_text
    if seq.finish_reason.value == "stop":
        json.loads(seq.output_text)


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square: the first appended token after a verified draft is distributed as the target."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.3, 0.3, 0.3, 0.3, 0.3]])
    params = SamplingParams(temperature=0.8, top_k=0)
    target = torch.softmax(logits[0] / 0.8, dim=-1)
    generator = torch.Generator().manual_seed(0)
    n = 20_000
    for draft_probs in (None, torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1]])):
        counts = torch.zeros(5)
        for _ in range(n):
            draft = [1] if draft_probs is None else [int(torch.multinomial(draft_probs[0], 1, generator=generator))]
            counts[verify(logits, draft, params, draft_probs=draft_probs, generator=generator).token_ids[0]] += 1
        expected = target * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 18.5, (chi2, counts)  # df = 4: p < 0.001 above 18.47


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_adds_the_target_token():
    logits = torch.full((4, 6), -5.0)
    for row, token in enumerate([2, 4, 1, 5]):
        logits[row, token] = 5.0
    verdict = verify(logits, [2, 4, 3], SamplingParams(temperature=0.0))
    assert verdict.num_accepted == 2 and verdict.token_ids == [2, 4, 1]
    assert verify(logits, [2, 4, 1], SamplingParams(temperature=0.0)).token_ids == [2, 4, 1, 5]


def test_adaptive_k_drafts_longer_when_drafts_are_accepted():
    costs = [0.3 * j for j in range(1, 9)]
    assert best_k(0.95, costs) > best_k(0.6, costs) >= best_k(0.2, costs) == 1


def test_drafting_fades_out_as_the_batch_grows():
    def one_token(rows: int) -> float:
        return DEFAULT_STEP_COST.draft_costs(rows, 1)[0]

    assert one_token(1) < one_token(4) < one_token(16)
    alpha = 0.6
    alone, crowded = DEFAULT_STEP_COST.draft_costs(1, 7), DEFAULT_STEP_COST.draft_costs(16, 7)
    k_alone, k_crowded = best_k(alpha, alone), best_k(alpha, crowded)
    assert gain(alpha, k_alone, alone[k_alone - 1]) > 1 > gain(alpha, k_crowded, crowded[k_crowded - 1])


def test_a_sequence_whose_drafts_fail_stops_drafting_in_a_big_step_and_tries_again_later():
    class Wrong:
        def __init__(self, context):
            pass

        def propose(self, seqs, limits):
            return [Proposal([(s.output_token_ids[-1] + 1) % 256] * k) for s, k in zip(seqs, limits)]

        def finish(self, seq):
            pass

    engine = make_engine()
    seq = engine.add_request("w", PROMPTS[2], GREEDY, speculation=SpeculationSpec(Wrong, "wrong", max_batch_size=8))
    engine.step()
    for _ in range(3):  # learns that its drafts fail
        engine.step()
    state = seq.speculation
    assert state.acceptance_rate < 0.5  # below the prior: it has seen its drafts fail
    crowded, alone = DEFAULT_STEP_COST.draft_costs(8, 8), DEFAULT_STEP_COST.draft_costs(1, 8)
    assert engine.speculator.draft_limit(seq, crowded) == 0  # not worth it in a step of 8 rows
    for _ in range(10):
        engine.speculator.draft_limit(seq, crowded)
    assert engine.speculator.draft_limit(seq, alone) > 0  # the evidence faded: tried again
