"""Speculative decoding: DESIGN.md technique 7; docs/techniques/spec-decode.md.

The plugin class is in :mod:`.plugin`, its configuration in :mod:`.config`, the proposers in
:mod:`.suffix` (SuffixDecoding), :mod:`.ngram` (prompt lookup) and :mod:`.draft` (a draft model),
over the token index of :mod:`.token_index`. Verification is the engine's
(:mod:`loopstack.engine.speculator`).
"""

from __future__ import annotations

from loopstack.plugins.spec_decode.config import SpecDecodeConfig
from loopstack.plugins.spec_decode.plugin import SpecDecode

__all__ = ["PLUGIN", "SpecDecode", "SpecDecodeConfig"]

PLUGIN = SpecDecode
