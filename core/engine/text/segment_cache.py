"""Encode text a piece at a time between its added tokens, remembering recent pieces.

A chat request renders the whole conversation again every turn, and a byte-level BPE tokenizer
takes about a microsecond a token here (``tokenizers``: 0.78 ms for a 740-token prompt), so an
agent's 30,000-token context would cost 30 ms of tokenizing before its cached prefix is even
looked up. ``tokenizers`` splits a text at its added tokens (``<|im_start|>``, ``<|im_end|>``)
before anything else and encodes the pieces between them independently, so the ids of a text
are the ids of its pieces, in order, with each added token's id between them. A rendered
conversation's pieces are its messages: a new turn encodes only what is new.

Exactness is checked, not assumed: :meth:`SegmentCache.for_backend` returns ``None`` (encode
whole) unless the backend has no normalizer, no Metaspace pre-tokenizer (SentencePiece-style
prefixes depend on position), and no added token that strips or matches whole words; and it
compares both ways on a probe text. Pieces are kept least recently used first up to
``max_chars`` in all. Thread-safe (the API's event loop and guard threads share a tokenizer).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["SegmentCache"]

_PROBE = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Hi!  What's 12+7?\n\n```py\nprint('x')\n```<|im_end|>\n<|im_start|>assistant\n 19 <|im_end|>"
)


class SegmentCache:
    """Token ids of texts, encoded piece by piece between added tokens (see the module)."""

    def __init__(self, backend: BackendTokenizer, added: dict[str, int], *, max_chars: int = 4_000_000,
                 min_chars: int = 64) -> None:
        self._backend = backend
        self._added = added
        # longest first, so a token that is a prefix of another never wins over it
        alternatives = sorted(added, key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(token) for token in alternatives)) if added else None
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self.min_chars = min_chars  # shorter pieces are encoded each time (cheaper than keeping them)
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def for_backend(cls, backend: BackendTokenizer, **options: int) -> SegmentCache | None:
        """A cache for ``backend``, or None where piecewise encoding might differ from whole."""
        if backend.normalizer is not None or "Metaspace" in repr(backend.pre_tokenizer):
            return None
        added: dict[str, int] = {}
        for token_id, token in backend.get_added_tokens_decoder().items():
            if token.lstrip or token.rstrip or token.single_word or token.normalized:
                return None
            added[token.content] = token_id
        cache = cls(backend, added, **options)
        probe = _PROBE + "".join(f" {t} x" for t in sorted(added)[:64])
        if cache.encode(probe) != backend.encode(probe, add_special_tokens=False).ids:
            return None
        cache.clear()
        return cache

    def encode(self, text: str) -> list[int]:
        """``backend.encode(text, add_special_tokens=False).ids``, from kept pieces where it can."""
        if self._split is None:
            return list(self._piece(text))
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text):
            if match.start() > start:
                ids.extend(self._piece(text[start : match.start()]))
            ids.append(self._added[match.group()])
            start = match.end()
        if start < len(text):
            ids.extend(self._piece(text[start:]))
        return ids

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._chars = 0
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._pieces)

    def _piece(self, text: str) -> list[int] | array:
        if len(text) < self.min_chars:
            return self._backend.encode(text, add_special_tokens=False).ids
        with self._lock:
            kept = self._pieces.get(text)
            if kept is not None:
                self._pieces.move_to_end(text)
                self.hits += 1
                return kept
        ids = array("i", self._backend.encode(text, add_special_tokens=False).ids)
        if len(text) > self.max_chars:
            return ids
        with self._lock:
            self.misses += 1
            if text not in self._pieces:
                self._pieces[text] = ids
                self._chars += len(text)
            while self._chars > self.max_chars:
                evicted, _ = self._pieces.popitem(last=False)
                self._chars -= len(evicted)
        return ids
