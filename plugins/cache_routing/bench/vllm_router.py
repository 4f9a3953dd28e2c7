"""vllm-router as the routing benches run it: its own process in front of given servers, and the
streamed ``/v1/completions`` requests sent through it (or to any OpenAI-compatible server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from loopstack.plugins.cache_routing.bench.live import Chunk

__all__ = ["running_vllm_router", "stream_completion", "vllm_router_path"]


def vllm_router_path() -> Path | None:
    """The ``vllm-router`` executable of this environment (the bench extra), if installed."""
    path = Path(sys.executable).parent / "vllm-router"
    return path if path.exists() else None


class RouterExited(RuntimeError):
    """vllm-router stopped before it answered."""


async def _wait_ready(client: Any, url: str, process: subprocess.Popen[bytes], log: Path,
                      timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RouterExited(f"vllm-router exited with {process.returncode}: " + (" | ".join(tail) or "no output"))
        with contextlib.suppress(Exception):
            if (await client.get(url)).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise TimeoutError("vllm-router did not come up")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)
    if process.poll() is None:
        process.kill()


@contextlib.asynccontextmanager
async def running_vllm_router(worker_urls: Sequence[str], policy: str, client: Any,
                              attempts: int = 3) -> AsyncIterator[str]:
    """vllm-router with ``policy`` over ``worker_urls``, on loopback; yields its base URL once it
    answers, and stops it afterwards. A router that exits while starting (a port taken between
    choosing it and binding it) is started again on new ports, up to ``attempts`` times; the error
    then carries its last lines of output."""
    import tempfile

    from loopstack.bench.servers import free_port

    path = vllm_router_path()
    if path is None:
        raise FileNotFoundError("vllm-router is not installed here: pip install -e '.[bench]'")
    with tempfile.TemporaryDirectory(prefix="loopstack-vllm-router-") as folder:
        log = Path(folder) / "router.log"
        for attempt in range(attempts):
            port = free_port()
            command = [str(path), "--worker-urls", *worker_urls, "--policy", policy,
                       "--host", "127.0.0.1", "--port", str(port), "--health-check-endpoint", "/health",
                       "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port()),
                       "--log-level", "warning"]
            with log.open("wb") as output:
                process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            try:
                await _wait_ready(client, f"{url}/v1/models", process, log)
            except RouterExited:
                _stop(process)
                if attempt + 1 == attempts:
                    raise
                continue
            except BaseException:
                _stop(process)
                raise
            try:
                yield url
            finally:
                _stop(process)
            return


async def stream_completion(client: Any, url: str, body: dict[str, Any], session: str) -> AsyncIterator[Chunk]:
    """POST ``body`` (streamed) to ``url``/v1/completions with the conversation in ``x-session-id``;
    a chunk per text delta, and one with the usage where the server reports it."""
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                             headers={"x-session-id": session}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or ():
                yield Chunk(choice.get("text") or "")
            usage = chunk.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                yield Chunk("", usage.get("prompt_tokens"), details.get("cached_tokens") or 0,
                            usage.get("completion_tokens"))
