"""Starting vllm-router for the routing benches: a router that exits while starting is retried,
and the error names what it printed (a stand-in executable: no real router needed)."""

from __future__ import annotations

import asyncio
import stat

import httpx
import pytest

from loopstack.plugins.cache_routing.bench import vllm_router


def test_a_router_that_exits_while_starting_is_retried_and_its_output_reported(tmp_path, monkeypatch):
    starts = tmp_path / "starts"
    fake = tmp_path / "vllm-router"
    fake.write_text(f"#!/bin/sh\necho started >> {starts}\necho 'Address already in use (os error 98)'\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(vllm_router, "vllm_router_path", lambda: fake)

    async def start() -> None:
        async with httpx.AsyncClient() as client:
            async with vllm_router.running_vllm_router(["http://127.0.0.1:9"], "round_robin", client):
                pass

    with pytest.raises(vllm_router.RouterExited, match="exited with 1: Address already in use"):
        asyncio.run(start())
    assert starts.read_text().count("started") == 3
