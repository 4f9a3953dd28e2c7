"""The ``spec_decode`` plugin: answers ``loopstack_proposer`` with the configured proposer's spec.

The engine does the rest (:mod:`loopstack.engine.speculator`): it builds one proposer per spec
key, drafts for every speculating sequence in decode state, and verifies all drafts in the step's
one forward. A request whose arm has the plugin off gets no spec and decodes plainly, in the
same batches as the speculating ones.
"""

from __future__ import annotations

import functools

from loopstack.context import RequestContext
from loopstack.engine.seams.speculation import ProposerFactory, SpeculationSpec
from loopstack.hookspecs import hookimpl
from loopstack.plugin import Layer, Plugin
from loopstack.plugins.spec_decode.config import SpecDecodeConfig
from loopstack.plugins.spec_decode.draft_model import DraftModelOptions, DraftModelProposer
from loopstack.plugins.spec_decode.ngram import NgramOptions, NgramProposer
from loopstack.plugins.spec_decode.suffix import SuffixOptions, SuffixProposer

__all__ = ["SpecDecode", "build_spec"]


def build_spec(config: SpecDecodeConfig) -> SpeculationSpec:
    """The engine-side spec of ``config`` (plain data: it pickles to replica processes)."""
    options: DraftModelOptions | SuffixOptions | NgramOptions
    factory: ProposerFactory
    if config.proposer == "draft_model":
        options = DraftModelOptions(model=config.draft_model, num_layers=config.draft_layers,
                                    quantization=config.draft_quantization, num_kv_blocks=config.draft_kv_blocks,
                                    cost_per_token=config.draft_cost)
        factory = functools.partial(DraftModelProposer, options=options)
    elif config.proposer == "suffix":
        options = SuffixOptions(max_match=config.max_match, spec_factor=config.spec_factor,
                                min_prob=config.min_prob, global_tokens=config.global_tokens)
        factory = functools.partial(SuffixProposer, options=options)
    else:
        options = NgramOptions(min_n=config.min_n, max_n=config.max_n)
        factory = functools.partial(NgramProposer, options=options)
    return SpeculationSpec(factory, key=f"{config.proposer}:{options!r}",
                           num_speculative_tokens=config.k, adaptive=config.adaptive,
                           max_batch_size=config.max_batch_size)


class SpecDecode(Plugin):
    name = "spec_decode"
    layers = (Layer.INFERENCE,)
    Config = SpecDecodeConfig
    summary = "Draft tokens (suffix index, n-gram lookup or a draft model), verify them all in the step's one forward."

    config: SpecDecodeConfig

    def __init__(self, config: SpecDecodeConfig, *, arm: str = "default") -> None:
        super().__init__(config, arm=arm)
        self.spec = build_spec(config)

    @hookimpl
    def loopstack_proposer(self, ctx: RequestContext) -> SpeculationSpec:
        return self.spec
