"""Server-side token state of response chains: an LRU of token ids by response id.

A chain entry holds the token ids of a conversation as the chat template renders it up to
and including one response's output, without the generation prompt. A request that
continues the chain (``previous_response_id``) then tokenizes only what it adds: its new
input items, the generation prompt, and, once it completes, its own output. Entries share
their prefixes (each holds the segment it added and a link to its parent), so a session of
``n`` turns keeps its tokens once, not ``n`` times.

Visibility follows the store: an entry belongs to a tenant (another tenant's id misses),
and an entry of a ``store: false`` response is usable only by the connection that holds
that response (the caller passes the connection's local responses). A miss is never an
error: the caller rebuilds the prompt from the store, as without this cache.

Example::

    cache = ChainTokenCache(max_chains=1024)
    cache.put(entry)
    entry = cache.get("resp_...", tenant="default", local=None)   # None: rebuild from the store
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["ChainTokenCache", "ChainTokens", "TokenStateStatistics", "token_array"]

_INT32 = "i" if array("i").itemsize == 4 else "l"
MAX_SEGMENTS = 32  # past this many links, an entry copies its tokens into one segment


def token_array(token_ids: Any = ()) -> array:
    """Token ids packed as int32 (4 bytes a token, against ~36 in a list of ints)."""
    return array(_INT32, token_ids)


@dataclass(frozen=True, eq=False)
class ChainTokens:
    """Token ids of one response's chain (prompt + output, no generation prompt).

    Attributes:
        response_id, tenant: whose chain this is.
        render_key: what the head of the prompt depends on (instructions, tools); a request
            with another key cannot extend this entry.
        request_fields: the non-input fields of the request that made the response (what a
            ``response.append`` inherits).
        tail: the conversation's last chat message (the context a suffix is rendered in).
        call_names: function-call id -> tool name, for every call in the chain.
        is_stored: ``store: true`` (visible to every connection of the tenant).
        segment: the token ids this entry adds after ``parent``.
        parent: the entry it extends, or None.
        num_tokens: tokens of the whole chain.
        depth: links from here to the root.
        tool_items: the chain's ``tool_search_output`` items (the tools they loaded stay
            callable in later requests).
    """

    response_id: str
    tenant: str
    render_key: str
    request_fields: Mapping[str, Any]
    tail: Mapping[str, Any] | None
    call_names: Mapping[str, str]
    is_stored: bool
    segment: array
    parent: ChainTokens | None
    num_tokens: int
    depth: int = 0
    tool_items: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def extend(cls, parent: ChainTokens | None, new_ids: array, **fields: Any) -> ChainTokens:
        """An entry that appends ``new_ids`` to ``parent`` (flattened every MAX_SEGMENTS links)."""
        if parent is not None and parent.depth + 1 >= MAX_SEGMENTS:
            flat = token_array(parent.token_ids())
            flat.extend(new_ids)
            return cls(segment=flat, parent=None, num_tokens=len(flat), depth=0, **fields)
        base = 0 if parent is None else parent.num_tokens
        depth = 0 if parent is None else parent.depth + 1
        return cls(segment=new_ids, parent=parent, num_tokens=base + len(new_ids), depth=depth, **fields)

    def token_ids(self) -> list[int]:
        """The chain's token ids, root first."""
        segments: list[array] = []
        node: ChainTokens | None = self
        while node is not None:
            segments.append(node.segment)
            node = node.parent
        ids = token_array()
        for segment in reversed(segments):
            ids.extend(segment)
        return ids.tolist()


class TokenStateStatistics(NamedTuple):
    num_chains: int
    max_chains: int
    num_hits: int
    num_misses: int
    num_evictions: int
    num_tokens_held: int  # tokens of the entries' own segments (shared prefixes counted once)


class ChainTokenCache:
    """Chain entries by (tenant, response id), least recently used evicted past ``max_chains``.

    Thread-safe (the event loop and worker threads may both use it).
    """

    def __init__(self, max_chains: int) -> None:
        if max_chains < 1:
            raise ValueError(f"max_chains must be at least 1, got {max_chains}")
        self.max_chains = max_chains
        self._entries: OrderedDict[tuple[str, str], ChainTokens] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    def get(self, response_id: str, *, tenant: str, local: Container[str] | None) -> ChainTokens | None:
        """The entry of ``response_id`` as ``tenant`` sees it, or None.

        ``local`` holds the ids of the caller's connection-local (``store: false``)
        responses; an unstored entry is returned only when its id is among them.
        """
        key = (tenant, response_id)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.is_stored and (local is None or response_id not in local):
                entry = None
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def put(self, entry: ChainTokens) -> None:
        with self._lock:
            key = (entry.tenant, entry.response_id)
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_chains:
                self._entries.popitem(last=False)
                self._evictions += 1

    def discard(self, response_id: str, *, tenant: str) -> None:
        with self._lock:
            self._entries.pop((tenant, response_id), None)

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> TokenStateStatistics:
        with self._lock:
            held = sum(len(e.segment) for e in self._entries.values())
            return TokenStateStatistics(len(self._entries), self.max_chains, self._hits, self._misses,
                                        self._evictions, held)
