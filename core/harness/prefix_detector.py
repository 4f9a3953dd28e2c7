"""Prefix-break detector: does each request of a session extend the one before it?

An engine's prefix cache (and a provider's prompt cache) only helps when request *n+1*
starts with request *n*. The agent loop calls :func:`check_request` on every request it is
about to send, whether or not the ``prefix_pinning`` plugin is on, so a break is a
diagnostic you can act on rather than a silent slowdown.

**What is compared.** Not the request body: a JSON object with sorted keys puts ``input``
before ``instructions``, and the body's closing ``]`` of the ``input`` array moves every turn,
so "body n+1 starts with body n" is never true even for a perfect loop. The detector
compares a *prefix form* instead, in the order the model reads the prompt::

    model=<json>\\ninstructions=<json>\\ntools[0]=<json>\\n ... input[0]=<json>\\n ...

one segment per line. Tool segments keep the schemas' key order (it reaches the prompt:
tools are rendered as JSON); every other segment is canonical JSON (sorted keys). Fields
that do not reach the prompt's prefix (``temperature``, ``tool_choice``, ``stream``,
``prompt_cache_key``, ...) are left out. Input items a plugin appends for one request
only can be marked with :func:`prefix_policy` (``num_ephemeral_tail_items``); they are
left out of the form the next request is compared with.

**What a break records** (:class:`PrefixBreak`): the first differing byte of the prefix
form, the item (``tools[3]``, ``input[12]``) and field (``tools[3].name``) responsible,
a cause label (one of :data:`CAUSES`), and a human line with the fix. Each break counts in
``prefix_breaks_total{cause}`` and is logged on logger ``loopstack.prefix`` (WARNING; an
explicit compaction logs at INFO). Strict mode raises :class:`PrefixBreakError` instead of
carrying on (an explicit compaction never raises): set ``detector_for(session).strict``,
``strict = true`` in ``[plugins.prefix_pinning]``, or ``LOOPSTACK_PREFIX_STRICT=1``.

Example::

    detector = detector_for(session)
    detector.strict = True            # a test of a plugin that must not break the prefix
    result = await agent.run(task)    # raises PrefixBreakError on the first break
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from loopstack.harness.prefix_causes import (
    CAUSES,
    VOLATILE_PATTERNS,
    Segment,
    classify,
    common_prefix,
    excerpt,
    kind_of,
    mask_volatile,
    prefix_form,
    prefix_segments,
    secondary_causes,
)
from loopstack.types import StateKey

if TYPE_CHECKING:
    from loopstack.context import RequestContext, Session

__all__ = [
    "CAUSES",
    "METRIC",
    "STRICT_ENV",
    "VOLATILE_PATTERNS",
    "PrefixBreak",
    "PrefixBreakError",
    "PrefixDetector",
    "PrefixDetectorStatistics",
    "PrefixPolicy",
    "Segment",
    "check_request",
    "detector_for",
    "mask_volatile",
    "prefix_form",
    "prefix_policy",
    "prefix_segments",
]

log = logging.getLogger("loopstack.prefix")

METRIC = "prefix_breaks_total"
STRICT_ENV = "LOOPSTACK_PREFIX_STRICT"

# -- what a break is ------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixBreak:
    """Request ``request_index`` of a session does not start with the one before it.

    Attributes:
        cause: one of :data:`CAUSES`.
        byte_offset: first differing byte of the prefix form (:func:`prefix_form`).
        item: the segment responsible (``instructions``, ``tools[3]``, ``input[12]``).
        field: the field path inside it (``tools[3].name``, ``input[12].output``).
        detail: what changed and how to fix it, for a person.
        oldexcerpt, newexcerpt: the prefix form around ``byte_offset``, before and now.
        token_offset: first differing prompt token, when token ids were given.
        cached_bytes: bytes of the previous form that are still a prefix (the reusable part).
        also: causes found further on, in other parts of the request (instructions, tools,
            history): what would still break the prefix once ``cause`` is fixed.
    """

    session_id: str
    request_index: int
    cause: str
    byte_offset: int
    item: str
    field: str
    detail: str
    oldexcerpt: str = ""
    newexcerpt: str = ""
    token_offset: int | None = None
    cached_bytes: int = 0
    also: tuple[str, ...] = ()

    def log_line(self) -> str:
        where = f"byte {self.byte_offset}" + (f", token {self.token_offset}" if self.token_offset is not None else "")
        also = f" (also further on: {', '.join(self.also)})" if self.also else ""
        return (f"prefix break in session {self.session_id} request {self.request_index}: {self.cause} at {where} "
                f"({self.field}){also}: {self.detail} [before: {self.oldexcerpt!r} now: {self.newexcerpt!r}]")


class PrefixBreakError(RuntimeError):
    """Strict mode: a request broke the session's prefix. ``prefix_break`` says how."""

    def __init__(self, prefix_break: PrefixBreak) -> None:
        super().__init__(prefix_break.log_line())
        self.prefix_break = prefix_break


class PrefixDetectorStatistics(NamedTuple):
    num_requests: int
    num_breaks: int
    breaks_by_cause: dict[str, int]


# -- the detector ---------------------------------------------------------------------------


@dataclass
class PrefixPolicy:
    """Per-request hints from plugins, read by :func:`check_request`.

    Attributes:
        num_ephemeral_tail_items: the last N input items exist for this request only (for
            example a reminder a plugin appends to each request); the next request is not
            expected to repeat them.
        strict: raise on a break (``[plugins.prefix_pinning] strict``).
        volatile_patterns: regexes of volatile values (default :data:`VOLATILE_PATTERNS`).
    """

    num_ephemeral_tail_items: int = 0
    strict: bool = False
    volatile_patterns: tuple[str, ...] = VOLATILE_PATTERNS


@dataclass
class PrefixDetector:
    """Per-session state: the previous request's prefix form and the breaks seen."""

    strict: bool = False
    num_requests: int = 0
    breaks: list[PrefixBreak] = field(default_factory=list)
    _previous: list[Segment] | None = field(default=None, repr=False)
    _previous_tokens: list[int] | None = field(default=None, repr=False)

    def check(self, request: Mapping[str, Any], *, session_id: str = "", num_ephemeral_tail_items: int = 0,
              is_compaction: bool = False, token_ids: Sequence[int] | None = None,
              volatile_patterns: Sequence[str] = VOLATILE_PATTERNS) -> PrefixBreak | None:
        """Compare ``request`` with the previous one; remember it; return the break, if any.

        ``token_ids``: the request's prompt tokens, when the caller has them (the previous
        request's stable tokens are then compared too, for ``token_offset``).
        """
        self.num_requests += 1
        segments = prefix_segments(request)
        stable = segments[: len(segments) - num_ephemeral_tail_items] if num_ephemeral_tail_items else segments
        previous, previous_tokens = self._previous, self._previous_tokens
        self._previous, self._previous_tokens = stable, (list(token_ids) if token_ids is not None else None)
        if previous is None:
            return None
        offset = 0
        for index, old in enumerate(previous):
            new = segments[index] if index < len(segments) else None
            if new is not None and new.data == old.data:
                offset += len(old.data)
                continue
            within = common_prefix(old.data, new.data) if new is not None else 0
            old_form = b"".join(s.data for s in previous)
            new_form = b"".join(s.data for s in segments)
            found = classify(previous, segments, index, is_compaction=is_compaction, patterns=volatile_patterns)
            token_offset = (common_prefix(previous_tokens, token_ids)
                            if previous_tokens is not None and token_ids is not None else None)
            also = secondary_causes(previous, segments, kind_of(old), is_compaction=is_compaction,
                                     patterns=volatile_patterns)
            prefix_break = PrefixBreak(session_id, self.num_requests, found.cause, offset + within, old.label,
                                       found.field, found.detail, excerpt(old_form, offset + within),
                                       excerpt(new_form, offset + within), token_offset, offset + within,
                                       tuple(c for c in also if c != found.cause))
            self.breaks.append(prefix_break)
            return prefix_break
        return None

    def statistics(self) -> PrefixDetectorStatistics:
        return PrefixDetectorStatistics(self.num_requests, len(self.breaks), dict(Counter(b.cause for b in self.breaks)))


_DETECTOR = StateKey("loopstack.prefix", PrefixDetector)  # per session
_POLICY = StateKey("loopstack.prefix.request", PrefixPolicy)  # per request


def detector_for(session: Session) -> PrefixDetector:
    """The session's detector (created on first use)."""
    return session.state(_DETECTOR)


def prefix_policy(ctx: RequestContext) -> PrefixPolicy:
    """This request's :class:`PrefixPolicy`; plugins set it in ``loopstack_prepare_request``."""
    return ctx.state(_POLICY)


def _is_strict_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_request(request: Mapping[str, Any], ctx: RequestContext, *, is_compaction: bool = False,
                  token_ids: Sequence[int] | None = None) -> PrefixBreak | None:
    """Check the request the harness is about to send against the session's previous one.

    Counts a break in ``prefix_breaks_total{cause}`` and logs it on ``loopstack.prefix``.

    Raises:
        PrefixBreakError: a break (other than an explicit compaction) in strict mode.
    """
    detector = detector_for(ctx.session)
    policy = prefix_policy(ctx)
    prefix_break = detector.check(request, session_id=ctx.session.id, is_compaction=is_compaction,
                                  num_ephemeral_tail_items=policy.num_ephemeral_tail_items, token_ids=token_ids,
                                  volatile_patterns=policy.volatile_patterns)
    if prefix_break is None:
        return None
    ctx.count(METRIC, help="requests that do not start with the session's previous request, by cause",
              cause=prefix_break.cause)
    if prefix_break.cause == "compaction":
        log.info("%s", prefix_break.log_line())
        return prefix_break
    log.warning("%s", prefix_break.log_line())
    if detector.strict or policy.strict or _is_strict_env():
        raise PrefixBreakError(prefix_break)
    return prefix_break
