"""KV cache events: which prefix blocks an engine's cache stored and dropped.

They are the input a cache-aware router needs to know which replica holds which prefix ("precise"
mode); no router is built yet, so today the block manager publishes them and tests consume them.
The three event kinds and their payload fields mirror what vLLM publishes over ZeroMQ
(``vllm.distributed.kv_events``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), so one
consumer reads the embedded engine's events and a remote vLLM replica's events the same way.
:func:`hash_block_tokens` is the embedded engine's block hash, so a router can hash a request's
prefix and look it up (vLLM replicas hash with their own scheme: match their hashes with theirs).

Every event carries ``sequence_number`` (1, 2, 3, ... per bus, assigned on publish, so a consumer can
detect gaps after a dropped buffer) and ``timestamp`` (``time.time()`` at publish, seconds since the
epoch, comparable across processes on one host). Events are frozen: share them freely across threads.

Example::

    bus = KVEventBus()
    unsubscribe = bus.subscribe(lambda event: print(event))
    bus.publish(AllBlocksCleared())
    unsubscribe()
    events = bus.drain()  # pull-style consumers read the bounded buffer instead
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias, TypeVar

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "HashFn",
    "KVCacheEvent",
    "KVEventBus",
    "KVEventBusStatistics",
    "KVEventCallback",
    "hash_block_tokens",
    "hash_token_blocks",
]

logger = logging.getLogger(__name__)

# The embedded engine publishes 16-byte digests; vLLM publishes ints or bytes depending on version.
BlockHash: TypeAlias = bytes | int
HashFn: TypeAlias = Callable[[bytes | None, Sequence[int], bytes], bytes]


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], salt: bytes = b"") -> bytes:
    """The embedded engine's chained hash of one full block, as published in BlockStored.

    blake2b-128 over a canonical, platform-independent encoding, so a consumer in another process
    (a router) computes the same hashes for a request's prefix. ``parent_hash`` is ``None`` for a sequence's first
    block; only that block is given the ``salt`` (the chain carries it on). Token ids must fit int64.
    """
    digest = hashlib.blake2b(digest_size=16, person=b"loopstack.kv.v1")
    parent = parent_hash or b""
    # length prefixes keep the (parent, salt, tokens) boundaries unambiguous
    digest.update(struct.pack("<?I", parent_hash is not None, len(parent)) + parent)
    digest.update(struct.pack("<I", len(salt)) + salt)
    try:
        digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be 64-bit integers: {exc}") from None
    return digest.digest()


def hash_token_blocks(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Chained hashes of every full block of ``token_ids`` (a router matching a request's prefix)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        block_tokens = token_ids[start : start + block_size]
        hashes.append(hash_block_tokens(parent, block_tokens, salt if parent is None else b""))
    return hashes


@dataclass(frozen=True, kw_only=True)
class KVCacheEvent:
    """Base of all KV cache events; the bus fills both fields when the event is published."""

    sequence_number: int = 0  # 0 only on an event that was never published
    timestamp: float = 0.0


@dataclass(frozen=True)
class BlockStored(KVCacheEvent):
    """Full blocks became reusable prefix-cache entries.

    ``block_hashes`` is a chain: each hash covers its block's tokens and the hash before it, the first
    one chains from ``parent_hash`` (``None`` at the start of a sequence, where ``salt`` is mixed in).
    ``token_ids`` holds the tokens of all the blocks, concatenated (``len == block_size * len(hashes)``).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    salt: bytes | None = None
    lora_id: int | None = None  # vLLM field; the embedded engine has no LoRA
    medium: str | None = None  # vLLM field ("GPU", "CPU", ...); None means the primary KV cache


@dataclass(frozen=True)
class BlockRemoved(KVCacheEvent):
    """Blocks stopped being prefix-cache entries (evicted, or their content rolled back)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped: forget every block of this engine."""


KVEventCallback: TypeAlias = Callable[[KVCacheEvent], None]
_EventT = TypeVar("_EventT", bound=KVCacheEvent)


class KVEventBusStatistics(NamedTuple):
    """Counters of one :class:`KVEventBus`."""

    num_published: int
    num_subscribers: int
    num_buffered: int
    num_dropped: int  # pushed out of the full buffer before anyone drained them
    num_callback_errors: int


class KVEventBus:
    """Thread-safe fan-out of KV cache events to callbacks, plus a bounded buffer to poll.

    Callbacks run synchronously, in publish order, on the thread that is delivering: a publish that
    happens while another thread (or a callback) is delivering is queued and delivered by that thread
    right after, so every subscriber sees events in ``sequence_number`` order. Keep callbacks short
    (hand off to a queue). A callback that raises is logged and counted; the others still run.

    Args:
        buffer_size: how many of the newest events :meth:`drain` can return; older ones are dropped
            and counted in ``num_dropped``. 0 disables the buffer.
        clock: source of ``timestamp``.
    """

    def __init__(self, *, buffer_size: int = 4096, clock: Callable[[], float] = time.time) -> None:
        if buffer_size < 0:
            raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")
        self._clock = clock
        self._lock = threading.Lock()
        self._buffer: deque[KVCacheEvent] = deque(maxlen=buffer_size)
        self._pending: deque[KVCacheEvent] = deque()
        self._is_delivering = False
        self._subscribers: dict[int, KVEventCallback] = {}
        self._next_subscription_id = 0
        self._num_published = 0
        self._num_dropped = 0
        self._num_callback_errors = 0

    def subscribe(self, callback: KVEventCallback) -> Callable[[], None]:
        """Call ``callback(event)`` for every event published from now on.

        Returns:
            A function that removes this subscription; calling it again does nothing.
        """
        with self._lock:
            subscription_id = self._next_subscription_id
            self._next_subscription_id += 1
            self._subscribers[subscription_id] = callback

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers.pop(subscription_id, None)

        return unsubscribe

    def publish(self, event: _EventT) -> _EventT:
        """Stamp ``event`` with the next sequence number and the time, buffer it, deliver it.

        Returns:
            The stamped copy that subscribers receive.
        """
        with self._lock:
            self._num_published += 1
            stamped = dataclasses.replace(
                event, sequence_number=self._num_published, timestamp=self._clock()
            )
            if self._buffer.maxlen:
                if len(self._buffer) == self._buffer.maxlen:
                    self._num_dropped += 1
                self._buffer.append(stamped)
            self._pending.append(stamped)
            if self._is_delivering:
                return stamped  # the delivering thread picks it up, keeping the order
            self._is_delivering = True
        self._deliver_pending()
        return stamped

    def drain(self, max_events: int | None = None) -> list[KVCacheEvent]:
        """Remove and return the buffered events, oldest first (at most ``max_events``)."""
        with self._lock:
            count = len(self._buffer) if max_events is None else min(max_events, len(self._buffer))
            return [self._buffer.popleft() for _ in range(count)]

    def statistics(self) -> KVEventBusStatistics:
        """Counters since the bus was created."""
        with self._lock:
            return KVEventBusStatistics(
                num_published=self._num_published,
                num_subscribers=len(self._subscribers),
                num_buffered=len(self._buffer),
                num_dropped=self._num_dropped,
                num_callback_errors=self._num_callback_errors,
            )

    def _deliver_pending(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        self._is_delivering = False
                        return
                    event = self._pending.popleft()
                    callbacks = tuple(self._subscribers.values())
                for callback in callbacks:
                    try:
                        callback(event)
                    except Exception:
                        # a broken subscriber must not break the engine that publishes
                        logger.exception("KV event callback %r failed", callback)
                        with self._lock:
                            self._num_callback_errors += 1
        except BaseException:
            with self._lock:
                self._is_delivering = False  # the next publish delivers what is left
            raise
