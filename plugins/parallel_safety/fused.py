"""The fused input check: a guard's features taken from the request's own prefill.

The built-in classifier reads the mean residual stream after 8 decoder layers over the
text it checks. On the embedded engine those states are computed anyway, by the prefill
of the very prompt that contains the text: this module finds the token spans of the new
user and tool content in the prompt (:func:`content_spans`), keeps the first and last
``max_tokens / 2`` of them (:func:`head_and_tail`), and asks the response service for a
:class:`~loopstack.engine.capture.HiddenCapture` over them
(:meth:`ResponsesService.request_hidden_state`). The verdict then costs a dot product
when prefill passes the last span, instead of a forward of its own beside the prefill.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any

from loopstack.engine.capture import HiddenCapture

Span = tuple[int, int]

CHARS_PER_TOKEN = 4  # a first guess of the pieces' length in tokens (English BPE); the tail doubles on a miss


def content_spans(tokenizer: Any, prompt_ids: Sequence[int], pieces: Sequence[str]) -> list[Span] | None:
    """Token spans ``[start, end)`` of ``pieces`` in ``prompt_ids``, where they were rendered in
    this order at the end of the prompt (the request's new items), or None when one cannot be
    located exactly.

    Works on the token ids alone, so chained prompts (token state kept by the server) and
    rendered ones are alike: a tail of the prompt that starts at a special token is decoded,
    encoded again with character offsets (the ids must come back equal), and each piece is
    searched backwards from the end, the later pieces first. The first tail is about as long
    as the pieces; it doubles until every piece is found or it is the whole prompt.
    """
    pieces = [p for p in pieces if p.strip()]
    if not pieces or not prompt_ids:
        return None
    boundaries = _special_positions(tokenizer, prompt_ids)
    tail = max(1, sum(len(p) for p in pieces) // CHARS_PER_TOKEN)
    while True:
        start = max((p for p in boundaries if len(prompt_ids) - p >= tail), default=0)
        spans = _find_in_tail(tokenizer, prompt_ids, start, pieces)
        if spans is not None or start == 0:
            return spans
        tail = 2 * (len(prompt_ids) - start)


def text_capture(tokenizer: Any, prompt_ids: Sequence[int], pieces: Sequence[str], *, num_layers: int,
                 max_tokens: int) -> HiddenCapture | None:
    """The capture a fused check asks for: the head and tail ``max_tokens`` positions of
    ``pieces`` in the prompt, after ``num_layers`` layers; None when they cannot be located.
    The fitting script builds its features with this very function."""
    spans = content_spans(tokenizer, prompt_ids, pieces)
    if not spans:
        return None
    return HiddenCapture(num_layers=num_layers, spans=head_and_tail(spans, max_tokens))


def head_and_tail(spans: Sequence[Span], max_tokens: int) -> tuple[Span, ...]:
    """The first ``max_tokens // 2`` and the last ``max_tokens - max_tokens // 2`` positions of
    ``spans`` (all of them when they are no more), as sorted, merged spans: the same head and
    tail the standalone classifier keeps of a long text."""
    total = sum(end - start for start, end in spans)
    if total <= max_tokens:
        return _merged(spans)
    head, tail = max_tokens // 2, max_tokens - max_tokens // 2
    kept: list[Span] = []
    seen = 0
    for start, end in spans:
        size = end - start
        if seen < head:  # part of the head
            kept.append((start, start + min(size, head - seen)))
        skip = max(0, total - tail - seen)  # positions of this span before the tail begins
        if skip < size:
            kept.append((start + skip, end))
        seen += size
    return _merged(kept)


def _merged(spans: Sequence[Span]) -> tuple[Span, ...]:
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)


def _special_positions(tokenizer: Any, prompt_ids: Sequence[int]) -> list[int]:
    # an added special token is matched before pre-tokenization, so text that starts at one
    # encodes exactly as that part of the whole prompt does
    special = {i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    return [i for i, token_id in enumerate(prompt_ids) if token_id in special]


def _find_in_tail(tokenizer: Any, prompt_ids: Sequence[int], start: int, pieces: Sequence[str]) -> list[Span] | None:
    tail = list(prompt_ids[start:])
    text = tokenizer.decode(tail, skip_special_tokens=False)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    if encoding.ids != tail:
        return None
    begins, ends = zip(*encoding.offsets) if encoding.offsets else ((), ())  # non-decreasing
    spans: list[Span] = []
    limit = len(text)
    for piece in reversed(pieces):
        at, length = _rfind(text, piece, limit)
        if at < 0:
            return None
        first = bisect_right(ends, at)  # the first token ending after the piece starts
        last = bisect_left(begins, at + length)  # past the last token starting inside it
        spans.append((start + first, start + last))
        limit = at
    return list(_merged(spans))


def _rfind(text: str, piece: str, limit: int) -> tuple[int, int]:
    """(offset, length) of the last occurrence of ``piece`` ending before ``limit``; templates
    that trim content are matched by the stripped piece."""
    for candidate in (piece, piece.strip()):
        at = text.rfind(candidate, 0, limit)
        if at >= 0:
            return at, len(candidate)
    return -1, 0
