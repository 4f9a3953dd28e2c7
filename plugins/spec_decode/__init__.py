"""Speculative decoding: DESIGN.md technique 7; docs/techniques/spec-decode.md.

The plugin class is in :mod:`.plugin`, its configuration in :mod:`.config`, the proposers in
:mod:`.suffix` (SuffixDecoding) and :mod:`.ngram` (prompt lookup), over the token index of
:mod:`.token_index`; the ``spec`` bench in :mod:`.bench`. Verification is the engine's
(:mod:`loopstack.engine.speculator`). A draft-model proposer is not built yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loopstack.hookspecs import hookimpl
from loopstack.plugins.spec_decode.config import SpecDecodeConfig
from loopstack.plugins.spec_decode.plugin import SpecDecode

if TYPE_CHECKING:
    from loopstack.bench.workload import Workload

__all__ = ["PLUGIN", "SpecDecode", "SpecDecodeConfig"]

PLUGIN = SpecDecode


@hookimpl
def loopstack_bench_workloads() -> list[Workload]:
    from loopstack.plugins.spec_decode.bench.workload import SpecWorkload

    return [SpecWorkload()]
