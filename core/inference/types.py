"""The routing contract: what a policy sees of a request and of each replica, and what it answers.

A router (:mod:`loopstack.inference.router` for live serving, the trace replay of the ``routing``
bench for modelled serving) builds one :class:`RouteRequest` per request and one
:class:`ReplicaView` per replica, asks a :class:`RoutingPolicy` (through the ``loopstack_route`` hook),
and gets a :class:`RouteDecision`. Policies are sans-I/O: they read these records and their own
state (a prefix index), never a socket, so the same policy object routes live traffic and a replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol, TypeAlias, runtime_checkable

from loopstack.engine.seams.kv_events import KVCacheEvent, hash_token_blocks

if TYPE_CHECKING:
    from loopstack.context import RequestContext

__all__ = ["KVEventListener", "RouteHints", "ReplicaListener", "ReplicaView", "RouteDecision", "RouteRequest", "RouterHandle", "RoutingPolicy"]


class RouteHints(NamedTuple):
    """What the API layer tells the router beside the prompt: the client's ``prompt_cache_key`` and
    the request's context (whose hooks are the request's A/B arms)."""

    cache_key: str | None = None
    ctx: RequestContext | None = None


@dataclass(eq=False)
class RouteRequest:
    """One request to place.

    ``salt`` is the tenant's cache salt: it enters the first block's hash, so two tenants' identical
    prompts have disjoint hash chains and never match each other's blocks. ``cache_key`` is the
    ``prompt_cache_key`` hint (or the session) a client sends; ``None`` when it sent none.
    """

    prompt_token_ids: Sequence[int]
    block_size: int
    salt: bytes = b""
    cache_key: str | None = None
    request_id: str = ""
    arrival_s: float = 0.0  # the router's clock when the request came in
    num_prompt_tokens: int | None = None  # when the ids stand for longer blocks (a trace's hash ids)
    tokens_per_block: int | None = None  # tokens one block stands for (None: block_size)

    @cached_property
    def block_hashes(self) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, as the embedded engine computes them.

        Only blocks before the last prompt token can ever be reused (an engine computes the last
        token's logits itself), so the chain stops there.
        """
        usable = self.prompt_token_ids[: max(0, len(self.prompt_token_ids) - 1)]
        return hash_token_blocks(usable, self.block_size, self.salt)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens if self.num_prompt_tokens is not None else len(self.prompt_token_ids)

    def cached_tokens(self, num_blocks: int) -> int:
        """Prompt tokens covered by ``num_blocks`` leading cached blocks."""
        return min(self.num_tokens, num_blocks * (self.tokens_per_block or self.block_size))


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica at decision time (its own accounting, no round trip).

    ``num_pending_prefill_tokens`` counts prompt tokens the router sent to this replica that are not
    cached there and whose first output has not come back yet: the replica's queued prefill work.
    """

    index: int
    name: str = ""
    is_healthy: bool = True
    num_in_flight: int = 0
    num_pending_prefill_tokens: int = 0
    num_active_tokens: int = 0  # prompt + generated tokens of the requests in flight (KV they hold)
    num_kv_blocks: int | None = None


@dataclass(frozen=True)
class RouteDecision:
    """The chosen replica and why.

    ``reason`` is a short code the metrics count by (``round_robin``, ``cache_hit``, ``load``,
    ``affinity``, ...). ``predicted_cached_blocks`` is the policy's belief of how many leading blocks
    the replica holds (``None``: the policy has no belief), compared with what the engine reports.
    ``shortest_first``: hold the request in the router's prefill admission when one is configured
    (:meth:`RouterHandle.configure_admission`), to be sent in shortest-prefill order; False: send at
    once (its prefill still counts against the replica's budget).
    """

    index: int
    reason: str
    predicted_cached_blocks: int | None = None
    scores: dict[int, float] = field(default_factory=dict, compare=False)  # for logs and tests
    shortest_first: bool = False


@runtime_checkable
class RoutingPolicy(Protocol):
    """A routing policy. ``choose`` picks among the healthy replicas of ``replicas`` (never empty).

    ``on_routed`` tells the policy where a request went (an approximate index learns from it).
    """

    name: str

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision: ...

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None: ...



KVEventListener: TypeAlias = Callable[[int, KVCacheEvent], None]  # (replica index, event)
ReplicaListener: TypeAlias = Callable[[int, bool], None]  # (replica index, is_healthy)


class RouterHandle(Protocol):
    """What a routing plugin sees of a started router (``loopstack_router_started``).

    ``publishes_kv_events(i)`` says whether replica ``i``'s cache is reported by KV events
    (embedded replicas, a vLLM with ``--kv-events-config``); their events, in each replica's
    ``sequence_number`` order, reach :meth:`subscribe_kv_events` listeners with hashes in the router's
    own chain (:func:`~loopstack.engine.seams.kv_events.hash_token_blocks`). Health listeners hear a
    replica leave (``False``: it died or stopped answering; its cache is gone or unknown) and rejoin.
    """

    @property
    def num_replicas(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def publishes_kv_events(self, index: int) -> bool: ...

    def subscribe_kv_events(self, listener: KVEventListener) -> Callable[[], None]: ...

    def subscribe_health(self, listener: ReplicaListener) -> Callable[[], None]: ...

    def configure_admission(self, *, budget_tokens: int | None, max_wait_s: float | None = None) -> None:
        """Hold ``shortest_first`` requests in the router until the replica's outstanding uncached
        prefill (sent, no first output yet) is under ``budget_tokens``, shortest prefill first; a
        request held ``max_wait_s`` goes first (None: never). ``budget_tokens=None`` turns it off."""
        ...
