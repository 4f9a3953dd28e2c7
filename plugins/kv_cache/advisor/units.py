"""A trace's requests as KV block units at a chosen block size (what the replay allocates).

Units from trace blocks (granularity ``g``, the trace's block size):

- ``block_size == g``: one unit per hash id;
- ``block_size == k * g``: one unit per k trace blocks, named by the group's last trace id (ids name
  prefixes) and the number of tokens it covers (a partial last unit differs from a full one);
- ``block_size < g`` (``g % block_size == 0``): ``g / block_size`` units per trace id, ``(id, i)``
  (as the integer ``id * g / block_size + i``). Sharing finer than the trace's granularity is
  invisible: two prompts that agree on half a trace block count as differing on all of it.

Content no trace id names (outputs without ``sequence_hash_ids``, blocks a row lacks ids for) gets
negative ids, which no trace id takes, so nothing shares it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from loopstack.plugins.kv_cache.advisor.traces import AdvisorRequest

__all__ = ["InfiniteCache", "UnitPlan", "infinite_cache", "plan_units"]


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """One request's units at one block size (computed once, replayed at every capacity/policy)."""

    prompt_units: tuple[int, ...]
    num_full_prompt_units: int
    sequence_units: tuple[int, ...]  # the full units cached at finish (prompt and output)
    num_common_units: int  # leading units the prompt's full units and the sequence share
    has_tail: bool  # the sequence ends in a partial unit (held, not cached)


@dataclass(frozen=True)
class InfiniteCache:
    """A cache that never evicts, filled in arrival order (timing ignored): the bound."""

    num_prompt_tokens: int
    num_hit_tokens: int
    working_set_tokens: int  # what it holds at the end: distinct cached units x block size

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def plan_units(requests: Sequence[AdvisorRequest], block_size: int) -> list[UnitPlan]:
    """Every request's units at ``block_size``.

    Raises:
        ValueError: ``block_size`` is neither a multiple nor a divisor of a request's granularity.
    """
    fresh = itertools.count(-1, -1)  # ids no trace id takes (trace ids are >= 0): unshared content
    return [_plan(request, block_size, fresh) for request in requests]


def _plan(request: AdvisorRequest, size: int, fresh: Iterator[int]) -> UnitPlan:
    prompt = _prompt_units(request, size, fresh)
    length = request.input_length
    num_full = length // size
    computed = max(length, length + request.output_length - 1)  # the last output token's KV is never written
    num_full_sequence = computed // size
    if request.sequence_hash_ids is None:
        sequence = list(prompt[:num_full])
        common = num_full
    else:
        sequence = _sequence_units(request, size)[:num_full_sequence]
        common = 0
        for a, b in zip(prompt[:num_full], sequence):
            if a != b:
                break
            common += 1
    sequence.extend(next(fresh) for _ in range(num_full_sequence - len(sequence)))
    return UnitPlan(prompt, num_full, tuple(sequence), common, computed % size != 0)


def _prompt_units(request: AdvisorRequest, size: int, fresh: Iterator[int]) -> tuple[int, ...]:
    g, length, ids = request.block_size, request.input_length, request.hash_ids
    num_trace = -(-length // g)
    if size == g:
        return tuple(ids[:num_trace]) + tuple(next(fresh) for _ in range(num_trace - len(ids)))
    if size % g == 0:
        k = size // g
        units = []
        for j in range(-(-length // size)):
            last = min((j + 1) * k, num_trace) - 1
            covered = min(size, length - j * size)
            # ids name prefixes: the group's last id and its token count name the unit's content
            units.append(ids[last] * (size + 1) + covered if last < len(ids) else next(fresh))
        return tuple(units)
    if g % size == 0:
        m = g // size
        units = []
        for t in range(num_trace):
            num_sub = -(-min(g, length - t * g) // size)
            units.extend(ids[t] * m + i if t < len(ids) else next(fresh) for i in range(num_sub))
        return tuple(units)
    raise ValueError(f"block size {size} is neither a multiple nor a divisor of the trace's {g}-token blocks")


def _sequence_units(request: AdvisorRequest, size: int) -> list[int]:
    g, ids = request.block_size, request.sequence_hash_ids or ()
    if size == g:
        return list(ids)
    if size % g == 0:
        k = size // g
        return [ids[(j + 1) * k - 1] * (size + 1) + size for j in range(len(ids) // k)]
    m = g // size
    return [h * m + i for h in ids for i in range(m)]


def infinite_cache(requests: Sequence[AdvisorRequest], block_size: int, plans: Sequence[UnitPlan] | None = None) -> InfiniteCache:
    """The never-evicting bound at ``block_size`` (each request's blocks stored on arrival)."""
    plans = plan_units(requests, block_size) if plans is None else plans
    nodes: dict[tuple[int, int], int] = {}  # (parent node, unit) -> node: the prefix tree
    num_prompt = num_hit = 0
    for request, plan in zip(requests, plans, strict=True):
        num_prompt += request.input_length
        parent = -1
        for unit in plan.prompt_units[: len(plan.prompt_units) - 1]:
            node = nodes.get((parent, unit))
            if node is None:
                break
            num_hit += block_size
            parent = node
        for units in (plan.prompt_units[: plan.num_full_prompt_units], plan.sequence_units):
            parent = -1
            for unit in units:
                parent = nodes.setdefault((parent, unit), len(nodes))
    return InfiniteCache(num_prompt, num_hit, len(nodes) * block_size)
