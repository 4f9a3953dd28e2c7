"""The last logits of recent prompts, so that a prompt sent again samples without a forward.

When a prompt's every token is still in the prefix cache (its last, partial block kept as a tail,
see :mod:`loopstack.engine.block_manager`) and the logits its last position gave are kept here, the
scheduler admits it with nothing to compute and the engine samples its first token from the kept
row: a retried or regenerated request costs no forward, as an exact repeat costs nothing in
llama.cpp's Python server. Rows are the raw model output (before grammar masks and penalties), so
any sampling parameters may use them. Keyed by salt and the prompt's tokens; least recently used
rows go first. Owned by the engine thread; not thread-safe.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["KeptLogits"]


class KeptLogits:
    """Up to ``capacity`` float32 logits rows on the host (a row is ``vocab_size * 4`` bytes)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_hits = 0
        # the last key and what it was computed from: a request's get (the scheduler) and put (the
        # engine) pass the same prompt list, which nothing changes once it is a sequence's
        self._last: tuple[Sequence[int], int, str, bytes] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, salt: str, prompt_token_ids: Sequence[int], logits: torch.Tensor) -> None:
        """Keep a copy of ``logits`` (``[vocab]``), the row of the prompt's last position (a
        prompt kept already keeps its row: the same tokens gave it)."""
        key = self._key(salt, prompt_token_ids)
        if key in self._rows:
            self._rows.move_to_end(key)
            return
        self._rows[key] = logits.detach().to("cpu", torch.float32, copy=True)
        self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def get(self, salt: str, prompt_token_ids: Sequence[int]) -> torch.Tensor | None:
        """The kept row (shared: copy before changing it), or None."""
        key = self._key(salt, prompt_token_ids)
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def _key(self, salt: str, prompt_token_ids: Sequence[int]) -> bytes:
        last = self._last
        if last is not None and last[0] is prompt_token_ids and last[1] == len(prompt_token_ids) and last[2] == salt:
            return last[3]
        key = _key(salt, prompt_token_ids)
        self._last = (prompt_token_ids, len(prompt_token_ids), salt, key)
        return key


def _key(salt: str, prompt_token_ids: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(salt.encode(), digest_size=16)
    digest.update(len(prompt_token_ids).to_bytes(8, "little"))
    digest.update(array("q", prompt_token_ids).tobytes())
    return digest.digest()
