"""vLLM's KV cache events, decoded and re-hashed into the router's own block-hash chain (sans-I/O).

A vLLM engine started with ``--kv-events-config`` publishes one msgpack payload per engine step: a
batch ``[ts, events, data_parallel_rank, publisher_id]`` (older versions stop after ``events`` or the
rank; one in-between state sends the batch as a map ``{"ts", "events", ...}``). Each event is one of
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, in one of two encodings:

- up to v0.23, a positional array whose first element is the class name:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, ...]``, with trailing fields left out when they hold their default;
- since vllm#42892 (v0.26 was captured so), a map tagged with ``"type"``:
  ``{"type": "BlockStored", "block_hashes": [...], ...}``, fields with defaults left out when None.

:func:`decode_batch` reads both, at both levels, by position or by name; fields it does not know
(newer versions) are ignored and fields newer than the producer default to None. Block hashes are
u64 ints (the default, the digest's last 8 bytes), full 32-byte digests, or, in v0.9, signed i64
from ``hash()`` (mapped to u64, so one block always has one key). Unknown event types are skipped
and counted; anything else that does not fit raises :class:`VLLMEventDecodeError`.

vLLM's hashes are of no use for matching unless the router reproduces vLLM's exact hash function and
seed, so :class:`HashTranslator` recomputes every stored block with
:func:`~loopstack.engine.seams.kv_events.hash_block_tokens` from the event's ``token_ids`` and keeps
``vLLM hash -> our hash`` to translate removals and later children. Only what the router can hash is
translated: the request's tokens plus the tenant salt (vLLM's ``cache_salt``, in the first block's
``extra_keys``). A block whose hash also covers a LoRA adapter, a multimodal item or prompt
embeddings ends the translation of its event, and blocks chained after it are then skipped as
unknown parents: the router never matches them, which is right, since its own hash of such a
request would not match vLLM's either.

Example::

    translator = HashTranslator()
    for event in translator.translate_batch(decode_batch(payload)):
        index.apply(replica, event)
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import msgpack

from loopstack.engine.seams.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    hash_block_tokens,
)

__all__ = [
    "HashTranslator",
    "HashTranslatorStatistics",
    "VLLMAllBlocksCleared",
    "VLLMBlockRemoved",
    "VLLMBlockStored",
    "VLLMEvent",
    "VLLMEventBatch",
    "VLLMEventDecodeError",
    "decode_batch",
]

logger = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
# positions in the array encoding (after the tag); the map encoding uses the same names
_BLOCK_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)
_BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank", "publisher_id")


class VLLMEventDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch; the message says which part is wrong."""


@dataclass(frozen=True)
class VLLMBlockStored:
    """vLLM's ``BlockStored``, hashes as vLLM sent them (ints normalised to u64)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None  # one entry per block
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True)
class VLLMBlockRemoved:
    """vLLM's ``BlockRemoved``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class VLLMAllBlocksCleared:
    """vLLM's ``AllBlocksCleared``: the engine dropped its whole prefix cache."""


VLLMEvent: TypeAlias = VLLMBlockStored | VLLMBlockRemoved | VLLMAllBlocksCleared


@dataclass(frozen=True)
class VLLMEventBatch:
    """One published payload. ``unknown_types`` names the skipped events of types this decoder lacks."""

    ts: float
    events: tuple[VLLMEvent, ...]
    data_parallel_rank: int | None = None
    publisher_id: bytes | None = None  # newest vLLM: changes when the engine restarts
    unknown_types: tuple[str, ...] = ()


def decode_batch(payload: bytes) -> VLLMEventBatch:
    """Decode one msgpack payload of vLLM's KV event publisher (either encoding, see the module docstring).

    Raises:
        VLLMEventDecodeError: the payload is not msgpack, or not shaped like an event batch.
    """
    try:
        raw = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # msgpack raises a handful of unrelated types
        raise VLLMEventDecodeError(f"payload is not valid msgpack: {exc}") from exc
    fields = _named_fields(raw, _BATCH_FIELDS, "batch")
    for name in ("ts", "events"):
        if name not in fields:
            raise VLLMEventDecodeError(f"batch: missing field {name!r}")
    ts, raw_events = fields["ts"], fields["events"]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise VLLMEventDecodeError(f"batch: 'ts' must be a number, got {type(ts).__name__}")
    if not isinstance(raw_events, list):
        raise VLLMEventDecodeError(f"batch: 'events' must be an array, got {type(raw_events).__name__}")
    publisher_id = fields.get("publisher_id")
    if publisher_id is not None and not isinstance(publisher_id, bytes):
        raise VLLMEventDecodeError(f"batch: 'publisher_id' must be bytes, got {type(publisher_id).__name__}")
    events: list[VLLMEvent] = []
    unknown: list[str] = []
    for position, raw_event in enumerate(raw_events):
        tag, event_fields = _tagged_fields(raw_event, position)
        where = f"event {position} ({tag})"
        if tag == "BlockStored":
            events.append(_block_stored(event_fields, where))
        elif tag == "BlockRemoved":
            events.append(VLLMBlockRemoved(
                block_hashes=_hashes(_required(event_fields, "block_hashes", where), where),
                medium=_optional_str(event_fields, "medium", where),
                group_idx=_optional_int(event_fields, "group_idx", where),
            ))
        elif tag == "AllBlocksCleared":
            events.append(VLLMAllBlocksCleared())
        else:
            unknown.append(tag)
    return VLLMEventBatch(
        ts=float(ts),
        events=tuple(events),
        data_parallel_rank=_optional_int(fields, "data_parallel_rank", "batch"),
        publisher_id=publisher_id,
        unknown_types=tuple(unknown),
    )


class HashTranslatorStatistics(NamedTuple):
    num_entries: int  # vLLM hashes currently mapped
    num_emitted: int
    num_skipped_unknown_parent: int  # BlockStored events dropped: their parent was never seen (or forgotten)
    num_skipped_group: int  # events of another KV cache group
    num_unreproducible_blocks: int  # blocks whose vLLM hash covers more than tokens and the cache salt
    num_evicted: int  # entries dropped by the size bound


@dataclass(slots=True)
class _Entry:
    ours: bytes
    copies: dict[str | None, int]  # medium -> blocks vLLM holds with this hash (it does not deduplicate)


class HashTranslator:
    """vLLM events of one replica -> loopstack events whose hashes are the router's own chain.

    Output events are numbered 1, 2, 3, ... (from ``first_sequence_number``) in emission order, the
    contiguous numbering :class:`~loopstack.plugins.cache_routing.block_index.BlockIndex` checks; a
    new translator for a replica the index has seen needs ``index.reset_replica(replica)`` first.

    vLLM can hold several blocks with one hash (it does not deduplicate concurrent prefills), so a
    hash is counted per medium and its removal passes on only when the last copy goes. The map is
    bounded by ``max_entries`` (it mirrors the replica's cache, so size it above the cache's block
    count); the least recently stored or extended entry is dropped first, and passed on as removed.

    Args:
        group_idx: the KV cache group to follow (hybrid models publish one stream per group; pick
            the full-attention one). Events without ``group_idx`` count as group 0.
        max_entries: vLLM hashes remembered at most.
        first_sequence_number: the number of the first emitted event.
    """

    def __init__(self, *, group_idx: int = 0, max_entries: int = 4_000_000, first_sequence_number: int = 1) -> None:
        if max_entries < 1 or first_sequence_number < 1:
            raise ValueError(f"need max_entries >= 1 and first_sequence_number >= 1, got {max_entries}, "
                             f"{first_sequence_number}")
        self.group_idx = group_idx
        self.max_entries = max_entries
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently used first
        self._next_sequence = first_sequence_number
        self._num_emitted = self._num_skipped_parent = self._num_skipped_group = 0
        self._num_unreproducible = self._num_evicted = 0

    def translate_batch(self, batch: VLLMEventBatch) -> list[KVCacheEvent]:
        """Every event of ``batch``, translated, stamped with the batch's ``ts``."""
        return [out for event in batch.events for out in self.translate(event, timestamp=batch.ts)]

    def translate(self, event: VLLMEvent, *, timestamp: float = 0.0) -> list[KVCacheEvent]:
        """The loopstack events ``event`` amounts to (none when it is skipped)."""
        if isinstance(event, VLLMAllBlocksCleared):
            return [self.clear(timestamp=timestamp)]
        if (event.group_idx or 0) != self.group_idx:
            self._num_skipped_group += 1
            return []
        if isinstance(event, VLLMBlockStored):
            return self._stamp(self._stored(event), timestamp)
        return self._stamp(self._removed(event.block_hashes, event.medium), timestamp)

    def clear(self, *, timestamp: float = 0.0) -> AllBlocksCleared:
        """Forget every mapping; the returned event tells the index to forget the replica's blocks."""
        self._entries.clear()
        (cleared,) = self._stamp([AllBlocksCleared()], timestamp)
        assert isinstance(cleared, AllBlocksCleared)
        return cleared

    def our_hash(self, vllm_hash: BlockHash) -> bytes | None:
        """The router's hash of the block vLLM calls ``vllm_hash`` (None: not mapped)."""
        entry = self._entries.get(_normalised(vllm_hash))
        return None if entry is None else entry.ours

    def statistics(self) -> HashTranslatorStatistics:
        return HashTranslatorStatistics(
            num_entries=len(self._entries),
            num_emitted=self._num_emitted,
            num_skipped_unknown_parent=self._num_skipped_parent,
            num_skipped_group=self._num_skipped_group,
            num_unreproducible_blocks=self._num_unreproducible,
            num_evicted=self._num_evicted,
        )

    def _stored(self, event: VLLMBlockStored) -> list[KVCacheEvent]:
        parent: bytes | None = None
        if event.parent_block_hash is not None:
            parent_entry = self._entries.get(event.parent_block_hash)
            if parent_entry is None:
                self._num_skipped_parent += 1
                return []
            self._entries.move_to_end(event.parent_block_hash)
            parent = parent_entry.ours
        salt, num_blocks = self._reproducible_prefix(event)
        self._num_unreproducible += len(event.block_hashes) - num_blocks
        if not num_blocks:
            return []
        size, ours, previous = event.block_size, [], parent
        for i, vllm_hash in enumerate(event.block_hashes[:num_blocks]):
            block_hash = hash_block_tokens(previous, event.token_ids[i * size : (i + 1) * size],
                                           salt if previous is None else b"")
            entry = self._entries.get(vllm_hash)
            if entry is None:
                self._entries[vllm_hash] = _Entry(block_hash, {event.medium: 1})
            else:
                entry.copies[event.medium] = entry.copies.get(event.medium, 0) + 1
                self._entries.move_to_end(vllm_hash)
            ours.append(block_hash)
            previous = block_hash
        stored = BlockStored(
            block_hashes=tuple(ours), parent_hash=parent, token_ids=event.token_ids[: num_blocks * size],
            block_size=size, salt=salt or None, medium=event.medium,
        )
        return [stored, *self._evict()]

    def _reproducible_prefix(self, event: VLLMBlockStored) -> tuple[bytes, int]:
        """The salt of the event's first block and how many leading blocks the router can hash."""
        if event.lora_id is not None or event.lora_name is not None:
            return b"", 0  # the adapter is in every block's hash
        salt = b""
        for i, keys in enumerate(event.extra_keys or ()):
            if not keys:
                continue
            is_salt = (i == 0 and event.parent_block_hash is None and len(keys) == 1 and isinstance(keys[0], str))
            if not is_salt:
                return salt, i  # a multimodal item or prompt embeddings
            salt = str(keys[0]).encode()
        return salt, len(event.block_hashes)

    def _removed(self, vllm_hashes: Sequence[BlockHash], medium: str | None) -> list[KVCacheEvent]:
        gone: list[bytes] = []
        for vllm_hash in vllm_hashes:
            entry = self._entries.get(vllm_hash)
            copies = 0 if entry is None else entry.copies.get(medium, 0)
            if entry is None or not copies:
                continue  # never stored (skipped, or another medium), or already forgotten
            if copies > 1:
                entry.copies[medium] = copies - 1
                continue
            del entry.copies[medium]
            gone.append(entry.ours)
            if not entry.copies:
                del self._entries[vllm_hash]
        return [BlockRemoved(block_hashes=tuple(gone), medium=medium)] if gone else []

    def _evict(self) -> list[KVCacheEvent]:
        evicted: defaultdict[str | None, list[bytes]] = defaultdict(list)
        while len(self._entries) > self.max_entries:
            _, entry = self._entries.popitem(last=False)
            self._num_evicted += 1
            for medium in entry.copies:
                evicted[medium].append(entry.ours)
        return [BlockRemoved(block_hashes=tuple(hashes), medium=medium) for medium, hashes in evicted.items()]

    def _stamp(self, events: list[KVCacheEvent], timestamp: float) -> list[KVCacheEvent]:
        stamped = []
        for event in events:
            stamped.append(dataclasses.replace(event, sequence_number=self._next_sequence, timestamp=timestamp))
            self._next_sequence += 1
        self._num_emitted += len(stamped)
        return stamped


# -- decoding helpers -------------------------------------------------------------------------------


def _named_fields(raw: object, names: Sequence[str], where: str) -> Mapping[str, object]:
    """A positional array (extra trailing elements ignored) or a map, as name -> value."""
    if isinstance(raw, list):
        return dict(zip(names, raw))
    if isinstance(raw, dict):
        return raw
    raise VLLMEventDecodeError(f"{where}: expected an array or a map, got {type(raw).__name__}")


def _tagged_fields(raw: object, position: int) -> tuple[str, Mapping[str, object]]:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise VLLMEventDecodeError(f"event {position}: an array event must start with its type name")
        tag = raw[0]
        names = {"BlockStored": _BLOCK_STORED_FIELDS, "BlockRemoved": _BLOCK_REMOVED_FIELDS}.get(tag, ())
        return tag, dict(zip(names, raw[1:]))
    if isinstance(raw, dict):
        type_name = raw.get("type")
        if not isinstance(type_name, str):
            raise VLLMEventDecodeError(f"event {position}: a map event needs a string 'type', got {type_name!r}")
        return type_name, raw
    raise VLLMEventDecodeError(f"event {position}: expected an array or a map, got {type(raw).__name__}")


def _block_stored(fields: Mapping[str, object], where: str) -> VLLMBlockStored:
    block_hashes = _hashes(_required(fields, "block_hashes", where), where)
    parent = _required(fields, "parent_block_hash", where)
    token_ids = _required(fields, "token_ids", where)
    block_size = _required(fields, "block_size", where)
    if not isinstance(token_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
        raise VLLMEventDecodeError(f"{where}: 'token_ids' must be an array of ints")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise VLLMEventDecodeError(f"{where}: 'block_size' must be a positive int, got {block_size!r}")
    if len(token_ids) != block_size * len(block_hashes):
        raise VLLMEventDecodeError(f"{where}: {len(token_ids)} token ids for {len(block_hashes)} blocks of "
                                   f"{block_size}")
    extra_keys = fields.get("extra_keys")
    if extra_keys is not None:
        if not isinstance(extra_keys, list) or len(extra_keys) != len(block_hashes):
            raise VLLMEventDecodeError(f"{where}: 'extra_keys' must be an array with one entry per block")
        if any(keys is not None and not isinstance(keys, list) for keys in extra_keys):
            raise VLLMEventDecodeError(f"{where}: each 'extra_keys' entry must be an array or null")
    return VLLMBlockStored(
        block_hashes=block_hashes,
        parent_block_hash=None if parent is None else _hash(parent, f"{where}: 'parent_block_hash'"),
        token_ids=tuple(token_ids),
        block_size=block_size,
        lora_id=_optional_int(fields, "lora_id", where),
        medium=_optional_str(fields, "medium", where),
        lora_name=_optional_str(fields, "lora_name", where),
        extra_keys=None if extra_keys is None else tuple(
            None if keys is None else tuple(_frozen(key) for key in keys) for keys in extra_keys
        ),
        group_idx=_optional_int(fields, "group_idx", where),
        kv_cache_spec_kind=_optional_str(fields, "kv_cache_spec_kind", where),
    )


def _required(fields: Mapping[str, object], name: str, where: str) -> object:
    if name not in fields:
        raise VLLMEventDecodeError(f"{where}: missing field {name!r}")
    return fields[name]


def _optional_int(fields: Mapping[str, object], name: str, where: str) -> int | None:
    value = fields.get(name)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise VLLMEventDecodeError(f"{where}: {name!r} must be an int or null, got {value!r}")


def _optional_str(fields: Mapping[str, object], name: str, where: str) -> str | None:
    value = fields.get(name)
    if value is None or isinstance(value, str):
        return value
    raise VLLMEventDecodeError(f"{where}: {name!r} must be a string or null, got {value!r}")


def _hashes(raw: object, where: str) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list):
        raise VLLMEventDecodeError(f"{where}: 'block_hashes' must be an array, got {type(raw).__name__}")
    return tuple(_hash(value, f"{where}: 'block_hashes'") for value in raw)


def _hash(value: object, where: str) -> BlockHash:
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _U64  # v0.9's signed hash() values, as the u64 the same bits spell
    raise VLLMEventDecodeError(f"{where}: a block hash must be an int or bytes, got {type(value).__name__}")


def _normalised(vllm_hash: BlockHash) -> BlockHash:
    return vllm_hash & _U64 if isinstance(vllm_hash, int) else vllm_hash


def _frozen(value: object) -> object:
    return tuple(_frozen(item) for item in value) if isinstance(value, list) else value
