"""tool_search: terms, the BM25F index (ranking, exact names, incremental updates, bad input)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from rank_bm25 import BM25Okapi

from loopstack.plugins.tool_search.retrieval.index import FieldWeights, ToolDoc, ToolIndex
from loopstack.plugins.tool_search.retrieval.terms import identifier_words, normalize_name, terms

GITHUB = [
    ToolDoc("create_issue", "create_issue", "github", description="Open a new issue in a GitHub repository",
            parameters="owner repo title body labels"),
    ToolDoc("list_issues", "list_issues", "github", description="List issues in a repository, filtered by state",
            parameters="owner repo state"),
    ToolDoc("create_pull_request", "create_pull_request", "github", description="Open a pull request",
            parameters="owner repo head base"),
    ToolDoc("get_file_contents", "get_file_contents", "github", description="Read a file from a repository",
            parameters="owner repo path ref"),
    ToolDoc("send_sms", "send_sms", "46elks", description="Send an SMS message to a phone number",
            parameters="to message from"),
    ToolDoc("getWeatherForecast", "getWeatherForecast", "weather", description="Forecast for a city",
            parameters="city days"),
]


def _index(docs=GITHUB, **options) -> ToolIndex:
    index = ToolIndex(**options)
    for doc in docs:
        index.upsert(doc)
    return index


def test_identifiers_split_on_case_underscores_dashes_and_dots():
    assert identifier_words("getHTTPResponse") == ["get", "http", "response"]
    assert identifier_words("list_pull-requests.v2") == ["list", "pull", "requests", "v2"]
    assert terms("Listing the open Issues") == ["list", "open", "issu"]  # stop words gone, stemmed
    assert terms("issue") == terms("issues")
    assert normalize_name("Create-Issue") == normalize_name("createIssue") == "createissue"


def test_prose_query_finds_the_tool_that_does_it():
    index = _index()
    assert index.search("open a new issue about the crash", 3)[0].key == "create_issue"
    assert index.search("text my friend's phone", 3)[0].key == "send_sms"
    assert index.search("weather forecast in Paris", 1)[0].key == "getWeatherForecast"


def test_field_weights_change_the_ranking():
    docs = [ToolDoc("a", "deploy", description="x"), ToolDoc("b", "other", description="deploy deploy it")]
    by_name = _index(docs, weights=FieldWeights(name=5.0, description=0.2))
    by_description = _index(docs, weights=FieldWeights(name=0.2, description=5.0))
    assert by_name.search("deploy it now", 1)[0].key == "a"
    assert by_description.search("deploy it now", 1)[0].key == "b"


def test_exact_tool_name_ranks_first_whatever_bm25_says():
    docs = [*GITHUB, *(ToolDoc(f"d{i}", f"issue_helper_{i}", description="issue " * 8) for i in range(5))]
    index = _index(docs)
    for query in ("list_issues", "listIssues", "List-Issues", "please call list_issues for me"):
        assert index.search(query, 5)[0].key == "list_issues", query


def test_a_near_miss_of_a_one_word_name_ranks_first():
    index = _index()
    assert index.search("get_file_contens", 3)[0].key == "get_file_contents"
    assert index.search("zzzz_qqqq", 3) == []  # nothing close: nothing found


def test_single_field_scores_match_rank_bm25_ordering():
    corpus = ["send sms message phone", "read file repository", "open issue repository bug",
              "list issues repository state", "weather forecast city", "create pull request branch"]
    docs = [ToolDoc(str(i), f"t{i}", description=text) for i, text in enumerate(corpus)]
    index = _index(docs, weights=FieldWeights(name=0, namespace=0, title=0, description=1, parameters=0))
    okapi = BM25Okapi([terms(text) for text in corpus])
    # terms in fewer than half the documents: Okapi's idf is positive there, as ours always is
    for query in ("issues state", "phone message", "forecast", "pull request branch", "open bug issue"):
        ours = index.scores(query)[: len(corpus)]
        theirs = okapi.get_scores(terms(query))
        assert [i for i in sorted(range(len(corpus)), key=lambda i: -ours[i]) if ours[i] > 0] == \
               [i for i in sorted(range(len(corpus)), key=lambda i: -theirs[i]) if theirs[i] > 0]


def test_upsert_replaces_and_remove_forgets():
    index = _index()
    index.upsert(ToolDoc("send_sms", "send_sms", "46elks", description="Send a fax"))
    assert [h.key for h in index.search("fax", 3)] == ["send_sms"]
    assert [h.key for h in index.search("phone number", 5)] == []  # the old text is gone
    assert index.remove("send_sms") and not index.remove("send_sms")
    assert "send_sms" not in index and index.search("fax", 3) == []
    assert len(index) == len(GITHUB) - 1


def test_incremental_updates_equal_a_fresh_build():
    changed = [d for d in GITHUB if d.key != "list_issues"]
    changed.append(ToolDoc("delete_repo", "delete_repo", "github", description="Delete a repository forever"))
    incremental = _index()
    incremental.remove("list_issues")
    incremental.upsert(changed[-1])
    fresh = _index(changed)
    for query in ("delete repository", "open issue", "read a file", "sms"):
        a = {h.key: h.score for h in incremental.search(query, 10)}
        b = {h.key: h.score for h in fresh.search(query, 10)}
        assert a.keys() == b.keys() and all(math.isclose(a[k], b[k]) for k in a), query
    stats = incremental.statistics()
    assert stats.num_docs == len(changed) and stats.num_removes == 1


def test_bad_queries_come_back_empty_or_bounded():
    index = _index()
    assert index.search("", 5) == [] and index.search("   ?!  ", 5) == []
    assert index.search("the and of", 5) == []  # stop words only
    huge = " ".join(f"word{i}" for i in range(20_000)) + " sms"
    assert [h.key for h in index.search(huge, 5)] == ["send_sms"]  # rare terms kept, bounded time
    assert ToolIndex().search("anything", 5) == []


def test_allowed_restricts_hits():
    index = _index()
    hits = index.search("issue repository", 5, allowed={"list_issues"})
    assert [h.key for h in hits] == ["list_issues"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from(["sms", "issue file", "repo pull", "x y"])),
                max_size=25))
def test_any_sequence_of_updates_matches_a_fresh_build(operations):
    index, final = ToolIndex(), {}
    for key, text in operations:
        if text == "x y" and key in final:
            index.remove(key)
            del final[key]
        else:
            index.upsert(ToolDoc(key, key, description=text))
            final[key] = text
    fresh = _index([ToolDoc(k, k, description=t) for k, t in final.items()])
    for query in ("sms", "issue", "repo pull file"):
        assert {h.key for h in index.search(query, 10)} == {h.key for h in fresh.search(query, 10)}
        a = sorted(h.score for h in index.search(query, 10))
        b = sorted(h.score for h in fresh.search(query, 10))
        assert all(math.isclose(x, y) for x, y in zip(a, b))


def test_limit_is_respected_and_hits_are_best_first():
    hits = _index().search("repository", 2)
    assert len(hits) == 2 and hits[0].score >= hits[1].score


def test_retrieval_metrics_by_hand():
    from loopstack.plugins.tool_search.bench.datasets import Query, RetrievalSet
    from loopstack.plugins.tool_search.bench.quality import evaluate, lexical_overlap, ndcg_at, recall_at

    gold = frozenset({"a", "b"})
    assert recall_at(["a", "x", "b"], gold, 1) == 1.0 and recall_at(["x", "a"], gold, 1) == 0.0
    assert recall_at(["x", "a", "y", "z", "b"], gold, 5) == 1.0 and recall_at(["a"], gold, 5) == 0.5
    assert math.isclose(ndcg_at(["x", "a"], frozenset({"a"}), 10), 1 / math.log2(3))
    assert ndcg_at(["a", "b"], gold, 10) == 1.0
    dataset = RetrievalSet("t", GITHUB, [Query("send a text message", frozenset({"send_sms"})),
                                         Query("quantum cats", frozenset({"send_sms"}))])
    assert lexical_overlap(dataset) == 0.5
    scores = evaluate(_index(), dataset.queries)
    assert (scores.recall_at_1, scores.recall_at_5, scores.num_queries) == (0.5, 0.5, 2)


def test_a_catalog_sync_with_the_same_tools_touches_nothing():
    from loopstack.plugins.tool_search.catalog import CatalogIndex
    from loopstack.tools import ToolInfo

    infos = [ToolInfo(doc.name, doc.description, namespace="github") for doc in GITHUB]
    catalog = CatalogIndex()
    assert catalog.sync(infos).num_added == len(infos) and catalog.version == 1
    again = catalog.sync(list(infos))  # another request of the conversation: the same objects
    assert again[:3] == (0, 0, 0) and catalog.version == 1
    edited = [*infos[:-1], ToolInfo(infos[-1].name, "Merge a pull request now", namespace="github")]
    assert catalog.sync(edited)[:3] == (0, 1, 0) and catalog.version == 2  # a new object is looked at
    assert catalog.sync(edited[:-1])[:3] == (0, 0, 1) and catalog.version == 3
    equal = [ToolInfo(i.name, i.description, i.parameters, i.namespace) for i in edited[:-1]]
    assert catalog.sync(equal)[:3] == (0, 0, 0) and catalog.version == 3  # equal copies change nothing
