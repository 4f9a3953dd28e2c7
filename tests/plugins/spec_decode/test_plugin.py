"""The spec_decode plugin: its hook, its A/B arms, its spec reaching an engine, its proposers."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from loopstack.engine.async_engine import AsyncEngine
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.speculation import ProposerContext, SpeculationSpec
from loopstack.plugins.spec_decode.suffix import SuffixProposer
from loopstack.plugins.spec_decode.token_index import TokenIndex
from loopstack.runtime import StackRuntime
from loopstack.stack.errors import StackError
from loopstack.stack.loader import StackLoader
from tests.engine.support import PROMPTS, make_engine

AB = """
[plugins.spec_decode]
enabled = true
proposer = "suffix"
num_speculative_tokens = 5
[experiments.spec]
plugin = "spec_decode"
arms = { on = 0.5, off = 0.5 }
allow_override = true
"""


def runtime(catalog, write_stack, text=AB):
    return StackRuntime(StackLoader(catalog).load(write_stack("s", text)), catalog)


def test_the_on_arm_gets_a_spec_and_the_off_arm_none(catalog, write_stack):
    rt = runtime(catalog, write_stack)
    on, off = rt.context(overrides={"spec": "on"}), rt.context(overrides={"spec": "off"})
    spec = on.hooks.proposer(on)
    assert isinstance(spec, SpeculationSpec) and spec.num_speculative_tokens == 5 and spec.key.startswith("suffix:")
    assert off.hooks.proposer(off) is None
    assert pickle.loads(pickle.dumps(spec)).key == spec.key  # it travels to replica processes as it is
    rt.close()


def test_a_bad_proposer_names_the_allowed_values(catalog, write_stack):
    with pytest.raises(StackError, match="suffix.*ngram"):
        runtime(catalog, write_stack, '[plugins.spec_decode]\nenabled = true\nproposer = "medusa"\n')


def test_both_arms_share_a_batch_and_give_the_same_greedy_output(catalog, write_stack):
    rt = runtime(catalog, write_stack)
    spec = rt.context(overrides={"spec": "on"}).hooks.proposer(rt.context(overrides={"spec": "on"}))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = PROMPTS[0] * 2
    reference = make_engine().generate([prompt], params)[0].output_token_ids
    engine = AsyncEngine(make_engine())

    async def both():
        plain, fast = await asyncio.gather(
            engine.generate(prompt, params), engine.generate(prompt, params, speculation=spec))
        return plain, fast

    try:
        plain, fast = asyncio.run(both())
    finally:
        engine.shutdown()
    assert plain.token_ids == fast.token_ids == reference
    assert engine.engine.speculator.statistics.num_accepted > 0
    rt.close()


def test_suffix_index_proposes_the_most_frequent_continuation():
    index = TokenIndex((2,), max_match=8)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3, 7, 5, 1, 2])
    match = index.match(index.tokens)
    assert match is not None and match.length == 2
    assert index.continuation(match, 4, 0.1).token_ids[:2] == [3, 7]  # 7 follows twice, 9 once
    assert index.most_recent(match, 2) == [3, 7]


def test_the_global_index_learns_finished_outputs_per_tenant():
    class Seq:
        def __init__(self, rid, prompt, output, salt):
            self.request_id, self.prompt_token_ids, self.output_token_ids, self.salt = rid, prompt, output, salt

    proposer = SuffixProposer(ProposerContext(256, (0,), None, None))
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    proposer.finish(Seq("a", [1, 2], [9, 9, *answer], salt="tenant-a"))
    again = Seq("b", [3, 4], [9, 9, 40, 41], salt="tenant-a")
    [proposal] = proposer.propose([again], [6])
    assert proposal.token_ids[:4] == [42, 43, 44, 45]
    other = Seq("c", [3, 4], [9, 9, 40, 41], salt="tenant-b")
    assert proposer.propose([other], [6])[0].token_ids == []  # tenants never see each other's outputs
