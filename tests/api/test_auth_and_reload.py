"""Keys, tenants and live reload through a real server (sharing the session's engine)."""

from __future__ import annotations

import httpx
import pytest

from loopstack.api.server import ServerThread, build_state

KEYED_STACK = """
[stack]
extends = "baseline"
[api]
api_keys = ["sk-alice-1:alice", "sk-bob-2:bob"]
"""


@pytest.fixture(scope="module")
def keyed(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed")
    (folder / "keyed.toml").write_text(KEYED_STACK)
    state = build_state(folder / "keyed.toml", engine=server.state.engine, store_path=folder / "store.sqlite3")
    thread = ServerThread(state).start()
    yield thread, folder / "keyed.toml"
    thread.stop()
    state.store.close()
    state.live.close()


def post(url: str, key: str | None, **body):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/responses", json={"temperature": 0, "max_output_tokens": 4, **body},
                      headers=headers, timeout=120)


def test_requests_need_a_valid_key(keyed):
    thread, _ = keyed
    missing = post(thread.url, None, input="hi")
    wrong = post(thread.url, "sk-mallory", input="hi")
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert "sk-mallory" not in wrong.text
    assert post(thread.url, "sk-alice-1", input="hi").status_code == 200


def test_a_response_is_visible_only_to_its_tenant(keyed):
    thread, _ = keyed
    created = post(thread.url, "sk-alice-1", input="Remember 42.").json()
    headers = {"authorization": "Bearer sk-bob-2"}
    assert httpx.get(f"{thread.url}/v1/responses/{created['id']}", headers=headers).status_code == 404
    chained = post(thread.url, "sk-bob-2", input="What number?", previous_response_id=created["id"])
    assert chained.status_code == 400 and chained.json()["error"]["code"] == "previous_response_not_found"
    own = httpx.get(f"{thread.url}/v1/responses/{created['id']}", headers={"authorization": "Bearer sk-alice-1"})
    assert own.status_code == 200


def test_admin_reload_rejects_a_bad_stack_and_keeps_serving(keyed):
    thread, path = keyed
    headers = {"authorization": "Bearer sk-alice-1"}
    original = path.read_text()
    try:
        path.write_text(original + "\n[engine]\nreplicas = 0\n")
        rejected = httpx.post(f"{thread.url}/admin/reload", headers=headers, timeout=30)
        assert rejected.status_code == 400 and "engine.replicas" in " ".join(rejected.json()["issues"])
        assert post(thread.url, "sk-alice-1", input="still here?").status_code == 200
        path.write_text(original)
        assert httpx.post(f"{thread.url}/admin/reload", headers=headers, timeout=30).json()["ok"] is True
    finally:
        path.write_text(original)
