"""The engine's calibration of proposers' stated confidence, and drafts cut by it."""

from __future__ import annotations

import random

from loopstack.engine.draft_calibration import DraftCalibration
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.speculation import Proposal, ProposerContext, SpeculationSpec
from loopstack.engine.step_cost import DEFAULT_STEP_COST
from loopstack.plugins.spec_decode.config import SpecDecodeConfig
from loopstack.plugins.spec_decode.plugin import build_spec
from loopstack.plugins.spec_decode.suffix import SuffixProposer, draft_confidence
from loopstack.plugins.spec_decode.token_index import TokenIndex
from tests.engine.support import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ALONE = DEFAULT_STEP_COST.draft_costs(1, 24)  # a batch-1 step


def test_it_learns_what_a_stated_confidence_is_worth():
    calibration, rng = DraftCalibration(), random.Random(0)
    assert abs(calibration.calibrated(0.9) - 0.9) < 1e-9  # before any evidence: as stated
    for _ in range(400):  # a proposer that states 0.9 and is right 40% of the time
        calibration.record([0.9], 1 if rng.random() < 0.4 else 0)
    assert 0.3 < calibration.calibrated(0.9) < 0.5
    assert abs(calibration.calibrated(0.55) - 0.55) < 1e-9  # other bins untouched


def test_tokens_past_a_rejection_are_not_counted_as_rejected():
    calibration = DraftCalibration()
    for _ in range(200):
        calibration.record([0.55, 0.995], 0)  # the first token fails: the second was never judged
    assert calibration.calibrated(0.55) < 0.1 and calibration.calibrated(0.995) == 0.995


def test_a_confident_draft_is_kept_long_and_an_unsure_one_cut_or_dropped():
    calibration = DraftCalibration()
    def linear(per_token: float) -> list[float]:
        return [per_token * j for j in range(1, 25)]

    assert calibration.best_length([0.99] * 24, linear(0.05)) == 24
    assert calibration.best_length([0.99] * 4 + [0.3] * 20, linear(0.1)) == 4
    assert calibration.best_length([0.3] * 8, linear(0.5)) == 0  # fewer expected tokens than the rows cost
    assert calibration.best_length([], linear(0.05)) == 0


def test_suffix_confidence_grows_with_the_match_it_continues():
    index = TokenIndex((2,), max_match=16)
    long_run = list(range(100, 140))
    index.extend([*long_run, 7, *long_run[:30]])
    match = index.match(index.tokens)
    assert match is not None and match.length >= 16
    continuation = index.continuation(match, 8, 0.1)
    confidence = draft_confidence(match, continuation)
    assert continuation.token_ids == long_run[30:38] and all(c > 0.9 for c in confidence)
    index2 = TokenIndex((2,), max_match=16)
    index2.extend([1, 2, 3, 9, 1, 2, 3, 7, 1, 2])  # a 2-token match, continued two ways
    short = index2.match(index2.tokens)
    assert short is not None
    assert draft_confidence(short, index2.continuation(short, 4, 0.1))[0] < 0.7


class _Stated:
    """Proposes the plain continuation's first ``sure`` tokens, then wrong ones, stating 0.999 and 0.95."""

    plain: dict[str, list[int]] = {}
    sure = 3
    states_confidence = True

    def __init__(self, context) -> None:
        pass

    def propose(self, seqs, limits):
        out = []
        for seq, limit in zip(seqs, limits):
            n = len(seq.output_token_ids)
            draft = self.plain[seq.request_id][n : n + limit]
            draft = [*draft[: self.sure], *[(t + 1) % 256 for t in draft[self.sure :]]]  # the rest are wrong
            out.append(Proposal(draft, confidence=[0.999] * self.sure + [0.95] * (len(draft) - self.sure)))
        return out

    def finish(self, seq) -> None:
        pass


def test_the_engine_verifies_the_confident_part_of_each_draft_and_output_stays_greedy():
    _Stated.plain = {str(i): s.output_token_ids for i, s in enumerate(make_engine().generate(PROMPTS, GREEDY))}
    engine = make_engine()
    spec = SpeculationSpec(_Stated, "stated", num_speculative_tokens=12)
    seqs = [engine.add_request(str(i), p, GREEDY, speculation=spec) for i, p in enumerate(PROMPTS[:2])]
    drafted: list[int] = []
    while not all(s.is_finished for s in seqs):
        before = engine.speculator.statistics.num_proposed
        engine.step()
        drafted.append(engine.speculator.statistics.num_proposed - before)
    assert [s.output_token_ids for s in seqs] == [_Stated.plain["0"], _Stated.plain["1"]]
    calibration = engine.speculator.calibrations["stated"]
    # stated 0.95, so at first drafted past the sure tokens; seen to fail, then no longer verified
    assert drafted[1] > 2 * _Stated.sure and calibration.calibrated(0.95) < 0.7
    assert drafted[-4:-1] == [2 * _Stated.sure] * 3, drafted


def test_suffix_drafts_past_seven_tokens_by_default_where_its_match_is_long():
    spec = build_spec(SpecDecodeConfig(proposer="suffix"))
    assert spec.num_speculative_tokens == 24 and build_spec(SpecDecodeConfig(proposer="ngram")).num_speculative_tokens == 7

    class Seq:
        def __init__(self, request_id: str, output: list[int]) -> None:
            self.request_id, self.salt, self.output_token_ids = request_id, "", output
            self.prompt_token_ids = list(range(40, 90)) * 2

    proposer, calibration = SuffixProposer(ProposerContext(256, (0,), None, None)), DraftCalibration()
    [proposal] = proposer.propose([Seq("long", list(range(40, 60)))], [24])
    assert proposal.token_ids == list(range(60, 84)) and proposal.confidence is not None
    assert calibration.best_length(proposal.confidence, ALONE) > 7  # the old default cap
    [short] = proposer.propose([Seq("short", [7, 40, 41])], [24])  # a 2-token match: a short draft, or none
    assert short.confidence is not None and calibration.best_length(short.confidence, ALONE) <= 4
