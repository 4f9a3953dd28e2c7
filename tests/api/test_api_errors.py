"""Bad input gets a 4xx with an OpenAI-style error body naming the field."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_malformed_json(http):
    response = http.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"


def test_wrong_types_name_the_field(http):
    response = http.post("/v1/responses", json={"input": "hi", "temperature": "hot"})
    assert response.status_code == 400 and error_of(response)["param"] == "temperature"
    response = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 0})
    assert error_of(response)["param"] == "max_output_tokens"
    response = http.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 400 and error_of(response)["param"] == "messages"


def test_unknown_previous_response_id(http):
    response = http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    error = error_of(response)
    assert response.status_code == 400
    assert (error["param"], error["code"]) == ("previous_response_id", "previous_response_not_found")


def test_a_streamed_request_the_server_refuses_gets_a_json_error_not_a_stream(http):
    response = http.post("/v1/responses", json={"input": "hi", "stream": True, "previous_response_id": "resp_nope"})
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert error_of(response)["code"] == "previous_response_not_found"


def test_unknown_item_type_and_tool_choice(http):
    response = http.post("/v1/responses", json={"input": [{"type": "hologram"}]})
    assert response.status_code == 400 and error_of(response)["param"] == "input"
    response = http.post("/v1/responses", json={"input": "hi", "tool_choice": {"type": "function", "name": "nope"}})
    assert response.status_code == 400 and error_of(response)["param"] == "tool_choice"


def test_oversize_body(http, server):
    limit = server.state.max_body_bytes
    response = http.post("/v1/responses", content=b"x" * (limit + 1), headers={"content-type": "application/json"})
    assert response.status_code == 413 and error_of(response)["code"] == "body_too_large"


def test_prompt_longer_than_the_context(http, server):
    response = http.post("/v1/responses", json={"input": "word " * (server.state.engine.max_model_len + 10)})
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"


def test_unknown_route_and_method(http):
    assert http.get("/v1/nothing").status_code == 404
    assert error_of(http.get("/v1/nothing"))["code"] == "not_found"
    assert http.put("/v1/responses").status_code == 405


def test_arm_override_header_is_validated(http):
    response = http.post("/v1/responses", json={"input": "hi"}, headers={"x-loopstack-arms": "garbage"})
    assert response.status_code == 400 and error_of(response)["param"] == "x-loopstack-arms"


def test_the_server_still_serves_after_bad_requests(http):
    response = http.post("/v1/responses", json={"input": "What is the capital of France?", "temperature": 0,
                                                "max_output_tokens": 16})
    assert response.status_code == 200 and "Paris" in response.json()["output"][0]["content"][0]["text"]


def test_health_models_metrics(http):
    assert http.get("/healthz").json()["status"] == "ok"
    assert http.get("/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"
    metrics = http.get("/metrics").text
    assert "loopstack_requests_total" in metrics and "loopstack_api_responses_total" in metrics
