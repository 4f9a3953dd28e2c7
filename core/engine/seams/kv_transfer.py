"""Move a request, with its KV, from one engine to another (the disaggregation seam).

Two halves, so that the KV can travel by any connector while the rest is a small picklable record:

- :func:`export_state` snapshots a request in decode state — running, or a prefill-only request
  held after its first token (``FinishReason.HANDOFF``) — as a :class:`RequestState` (its tokens,
  sampling settings and random generator state, the tokens whose KV is computed) and the ids of
  the blocks holding that KV in the source engine.
- :func:`import_state` gives the request blocks in the other engine, reusing the blocks that engine
  already caches for the same prefix, asks ``load`` to fill only the others (a connector's
  receive: shared memory, TCP, or a plain copy), and schedules the request to decode from the next
  step. If ``load`` raises, the blocks are freed and nothing is scheduled.

:func:`export_request` / :func:`import_request` do both in one process, with the KV as one tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from loopstack.engine.llm_engine import LLMEngine
from loopstack.engine.sampling_params import SamplingParams
from loopstack.engine.seams.speculation import SpeculationSpec
from loopstack.engine.sequence import Sequence

__all__ = ["KVHandoff", "KVLoader", "PendingImport", "RequestState", "abandon_import", "begin_import",
           "complete_import", "export_request", "export_state", "import_request", "import_state"]

# load(first_block, destination_block_ids): write the KV of the request's blocks first_block.. into them
KVLoader = Callable[[int, Seq[int]], None]


@dataclass(frozen=True)
class RequestState:
    """A request as another engine needs it to continue decoding (everything but the KV)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    computed_token_ids: list[int]  # their KV travels: len(computed) // block_size full blocks and a tail
    params: SamplingParams
    salt: str
    block_size: int
    generator_state: torch.Tensor | None = None  # a seeded request's random state, so sampling goes on alike

    @property
    def num_blocks(self) -> int:
        return -(-len(self.computed_token_ids) // self.block_size)


@dataclass(frozen=True)
class KVHandoff:
    """:class:`RequestState` with its KV as one CPU tensor (a move inside one process)."""

    state: RequestState
    kv: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim], CPU

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def export_state(engine: LLMEngine, request_id: str) -> tuple[RequestState, tuple[int, ...]]:
    """The state of a running or held request and the block ids of its computed KV in ``engine``.

    Raises KeyError if the request is neither running nor held."""
    seq = engine.sequence(request_id) or engine.held_sequence(request_id)
    if seq is None:
        raise KeyError(f"unknown request {request_id!r}")
    exported = engine.block_manager.export_blocks(request_id)
    state = RequestState(
        request_id=request_id,
        prompt_token_ids=list(seq.prompt_token_ids),
        output_token_ids=list(seq.output_token_ids),
        computed_token_ids=list(exported.token_ids),
        params=seq.params,
        salt=seq.salt,
        block_size=exported.block_size,
        generator_state=seq.generator.get_state() if seq.generator is not None else None,
    )
    return state, exported.block_ids


@dataclass(frozen=True)
class PendingImport:
    """A request whose blocks are allocated in the destination engine, waiting for its KV
    (:func:`begin_import`); blocks ``first_block`` on are ``block_ids``, the rest were cached here."""

    seq: Sequence
    first_block: int
    block_ids: tuple[int, ...]
    num_cached_tokens: int

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def destination(self, first: int, count: int) -> tuple[int, ...]:
        """The destination block ids of the request's blocks ``first .. first + count``."""
        start = first - self.first_block
        return self.block_ids[start : start + count]


def begin_import(engine: LLMEngine, state: RequestState, *, speculation: SpeculationSpec | None = None) -> PendingImport:
    """Allocate ``state``'s blocks in ``engine`` (reusing cached ones) and build its sequence; it is
    not scheduled until :func:`complete_import` (or freed by :func:`abandon_import`).

    Raises:
        ValueError: a block-size mismatch, or the request id is taken here.
        OutOfBlocksError: no room (nothing changes).
    """
    if state.block_size != engine.block_manager.block_size:
        raise ValueError(f"block size {state.block_size} != this engine's {engine.block_manager.block_size}")
    if (engine.sequence(state.request_id) is not None or engine.held_sequence(state.request_id) is not None
            or state.request_id in engine.block_manager):
        raise ValueError(f"request id {state.request_id!r} is already in this engine")
    seq = engine.make_sequence(state.request_id, state.prompt_token_ids, state.params, salt=state.salt,
                               speculation=speculation)
    if state.generator_state is not None and seq.generator is not None:
        seq.generator.set_state(state.generator_state)
    assert seq.stop_checker is not None  # make_sequence gives every sequence one
    for token in state.output_token_ids:
        seq.stop_checker.feed(token)  # text state up to date; the text itself was already sent
        if seq.grammar is not None:
            seq.grammar.accept(token)
    seq.output_token_ids = list(state.output_token_ids)
    bm = engine.block_manager
    allocation = bm.import_sequence(state.request_id, state.computed_token_ids, salt=state.salt)
    first_block = allocation.num_cached_tokens // bm.block_size
    table = bm.block_table(state.request_id)
    return PendingImport(seq, first_block, tuple(table[first_block : state.num_blocks]), allocation.num_cached_tokens)


def complete_import(engine: LLMEngine, pending: PendingImport, state: RequestState) -> Sequence:
    """The KV of ``pending`` is written: schedule it to decode from the next step."""
    seq = pending.seq
    engine.block_manager.mark_computed(seq.request_id, state.computed_token_ids)
    seq.num_computed_tokens = len(state.computed_token_ids)
    seq.num_cached_prompt_tokens = min(pending.num_cached_tokens, len(state.prompt_token_ids))
    engine.add_running_sequence(seq)
    return seq


def abandon_import(engine: LLMEngine, pending: PendingImport) -> None:
    """Free the blocks of an import that will not complete (its transfer failed or was aborted)."""
    if pending.request_id in engine.block_manager:
        engine.block_manager.free(pending.request_id)


def import_state(engine: LLMEngine, state: RequestState, load: KVLoader) -> Sequence:
    """Continue ``state`` in ``engine``, its KV written by ``load`` (see the module docstring).

    Raises as :func:`begin_import`, and whatever ``load`` raises (its blocks are freed first).
    """
    pending = begin_import(engine, state)
    try:
        if pending.block_ids:
            load(pending.first_block, pending.block_ids)
    except BaseException:
        abandon_import(engine, pending)
        raise
    return complete_import(engine, pending, state)


def export_request(engine: LLMEngine, request_id: str) -> KVHandoff:
    """Snapshot a running or held request and its computed KV. Raises KeyError if unknown."""
    state, block_ids = export_state(engine, request_id)
    return KVHandoff(state, engine.runner.export_kv(block_ids))


def import_request(engine: LLMEngine, handoff: KVHandoff) -> Sequence:
    """Continue ``handoff`` in ``engine``. Raises ValueError on a block-size mismatch and
    OutOfBlocksError when the engine has no room (nothing changes then)."""

    def load(first_block: int, block_ids: Seq[int]) -> None:
        engine.runner.import_kv(block_ids, handoff.kv[:, :, first_block : first_block + len(block_ids)])

    return import_state(engine, handoff.state, load)
