"""The server's chain token state: LRU bounds and visibility, shared segments, the suffix probe."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopstack.api.auth import ANONYMOUS
from loopstack.api.prompt_suffix import SuffixRenderer
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.service import ResponsesService
from loopstack.api.store import ResponseStore
from loopstack.engine.text.tokenizer import Tokenizer
from loopstack.plugins.ws_deltas.chain_prompt import ChainPrompt
from loopstack.plugins.ws_deltas.token_state import MAX_SEGMENTS, ChainTokenCache, ChainTokens, token_array
from loopstack.testing.scripted_engine import ScriptedEngine
from tests.plugins.ws_deltas.support import runtime_of, tokenizer, write_stack  # noqa: F401  (fixture)


def _entry(response_id: str, *, tenant: str = "t", parent: ChainTokens | None = None, ids: Any = (1, 2),
           is_stored: bool = True) -> ChainTokens:
    return ChainTokens.extend(parent, token_array(ids), response_id=response_id, tenant=tenant, render_key="k",
                              request_fields={}, tail=None, call_names={}, is_stored=is_stored)


def test_cache_evicts_the_least_recently_used_past_max_chains():
    cache = ChainTokenCache(max_chains=3)
    for name in "abcd":
        cache.put(_entry(name))
    assert cache.get("a", tenant="t", local=None) is None  # evicted first
    assert cache.get("b", tenant="t", local=None) is not None  # now the most recent
    cache.put(_entry("e"))
    assert [cache.get(n, tenant="t", local=None) is not None for n in "bcde"] == [True, False, True, True]
    stats = cache.statistics()
    assert (stats.num_chains, stats.num_evictions) == (3, 2)


def test_cache_entries_are_visible_to_their_tenant_and_unstored_ones_to_their_connection():
    cache = ChainTokenCache(max_chains=8)
    cache.put(_entry("stored", tenant="alice"))
    cache.put(_entry("local", tenant="alice", is_stored=False))
    assert cache.get("stored", tenant="bob", local=None) is None
    assert cache.get("stored", tenant="alice", local=None) is not None
    assert cache.get("local", tenant="alice", local={"other"}) is None
    assert cache.get("local", tenant="alice", local={"local"}) is not None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50_000), max_size=6), min_size=1, max_size=3 * MAX_SEGMENTS))
def test_chained_segments_give_back_every_token_in_order(segments):
    entry, expected = None, []
    for index, segment in enumerate(segments):
        entry = _entry(f"r{index}", parent=entry, ids=segment)
        expected.extend(segment)
        assert entry.num_tokens == len(expected) and entry.depth < MAX_SEGMENTS
    assert entry is not None and entry.token_ids() == expected


def test_the_probe_accepts_the_default_models_template(tokenizer):  # noqa: F811
    assert SuffixRenderer(tokenizer).is_exact


REWRITING_TEMPLATE = (  # marks only the last user turn: appending a turn rewrites an earlier one
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last %} (latest){% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_history_falls_back_to_the_full_render(tmp_path, tokenizer):  # noqa: F811
    rewriting = Tokenizer(tokenizer.backend, bos_token_id=None, eos_token_ids=(2,), chat_template=REWRITING_TEMPLATE)
    assert not SuffixRenderer(rewriting).is_exact
    service = ResponsesService(ScriptedEngine(rewriting), ResponseStore(":memory:", ttl_s=60), model_name="m")
    ctx = runtime_of(write_stack(tmp_path)).context()  # ws_deltas on: it is asked for the prompt ids
    request = ResponsesRequest.model_validate({"input": "hi", "instructions": "Be brief."})
    prepared = service.prepare(request, ANONYMOUS, ctx=ctx, local={})
    assert prepared.prompt is None  # not served from the token state
    assert prepared.prompt_ids == rewriting.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi (latest)<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("instructions", ["Be brief.", None])
def test_a_full_request_with_token_state_tokenizes_like_prepare_without_it(tmp_path, tokenizer,  # noqa: F811
                                                                           instructions):
    service = ResponsesService(ScriptedEngine(tokenizer), ResponseStore(":memory:", ttl_s=60), model_name="m")
    request = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "Say <b>hi</b> twice"}],
                                               "instructions": instructions})
    ctx = runtime_of(write_stack(tmp_path)).context()
    with_state = service.prepare(request, ANONYMOUS, ctx=ctx, local={})
    answer = with_state.prompt
    assert isinstance(answer, ChainPrompt) and answer.prompts.kind == "full"
    assert answer.num_tokenized == len(with_state.prompt_ids)
    assert with_state.prompt_ids == service.prepare(request, ANONYMOUS).prompt_ids


def test_http_requests_are_not_served_from_the_token_state(tmp_path, tokenizer):  # noqa: F811
    service = ResponsesService(ScriptedEngine(tokenizer), ResponseStore(":memory:", ttl_s=60), model_name="m")
    request = ResponsesRequest.model_validate({"input": "hi"})
    ctx = runtime_of(write_stack(tmp_path)).context()
    assert service.prepare(request, ANONYMOUS, ctx=ctx, local=None).prompt is None  # no connection: no chain
