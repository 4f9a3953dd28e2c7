"""The advisor against the live server: replay agent sessions through ``loopstack serve`` with the
request log on, then predict the hit rate from that log alone and compare with what the engine did.

Sessions are built from the real mini-swe-agent trajectories in ``../shared/data`` (their system
prompt, task texts, assistant turns and shell observations, each cut to a length this CPU prefills in
seconds): every session shares the system prompt, then grows turn by turn, and the sessions take turns
(round robin), so a cache smaller than their working set is under the pressure agent fleets put on
it. Each request asks for one output token: the figure is the prefix cache, not decoding.

Live hit rate: the engine's own ``cached_tokens`` over prompt tokens, from the log's rows (what the
usage of every response said). Predicted: :func:`~loopstack.plugins.kv_cache.advisor.replay.replay`
of the same log at the server's block size, capacity, policy and pin share.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from loopstack.api.server import ServerThread, build_state, close_state
from loopstack.plugins.kv_cache.advisor.replay import ReplayConfig, replay
from loopstack.plugins.kv_cache.advisor.traces import load_requests

__all__ = ["LiveComparison", "agent_sessions", "compare_live"]

TRAJECTORIES = Path("trajectories") / "swebench_minisweagent" / "full_trajectories"


@dataclass(frozen=True)
class LiveComparison:
    policy: str
    num_requests: int
    num_prompt_tokens: int
    live_hit_rate: float
    predicted_hit_rate: float

    @property
    def error_points(self) -> float:
        return 100.0 * abs(self.predicted_hit_rate - self.live_hit_rate)


def agent_sessions(data_dir: Path, *, num_sessions: int, num_turns: int, chars: int = 700
                   ) -> tuple[str, list[list[list[dict[str, str]]]]]:
    """The shared system prompt, and per session the ``input`` of each turn (a growing history)."""
    folder = data_dir / TRAJECTORIES
    runs = [json.loads(path.read_text())["messages"] for path in sorted(folder.glob("*.traj.json"))]
    if not runs:
        raise FileNotFoundError(f"{folder}: no trajectories (they come with ../shared/data)")
    system = str(runs[0][0]["content"])
    sessions = []
    for s in range(num_sessions):
        messages = runs[s % len(runs)][1:]  # a run's task, then assistant / observation turns
        history = [{"role": "user", "content": f"Session {s}.\n{str(messages[0]['content'])[:chars * 2]}"}]
        turns = [list(history)]
        for t in range(1, num_turns):
            for message in messages[2 * t - 1 : 2 * t + 1]:
                history.append({"role": str(message["role"]), "content": str(message["content"])[:chars]})
            turns.append(list(history))
        sessions.append(turns)
    return system, sessions


def _stack(policy: str, num_kv_blocks: int, log: Path, pin_share: float) -> str:
    return textwrap.dedent(f"""
        [stack]
        name = "kv-live-{policy}"
        extends = "baseline"

        [engine]
        num_kv_blocks = {num_kv_blocks}
        max_model_len = 4096

        [plugins.kv_cache]
        enabled = true
        policy = "{policy}"
        max_pinned_share = {pin_share}
        request_log = "{log}"
    """).lstrip()


def compare_live(
    policy: str, *, data_dir: Path, workdir: Path, num_sessions: int = 8, num_turns: int = 6,
    num_kv_blocks: int = 256, pin_share: float = 0.25, progress: Callable[[str], None] = lambda _: None,
) -> LiveComparison:
    """Serve the sessions on a fresh server with ``policy``, then predict from its request log."""
    log = workdir / f"requests-{policy}.jsonl"
    log.unlink(missing_ok=True)
    stack = workdir / f"kv-live-{policy}.toml"
    stack.write_text(_stack(policy, num_kv_blocks, log, pin_share))
    system, sessions = agent_sessions(data_dir, num_sessions=num_sessions, num_turns=num_turns)
    state = build_state(stack, store_path=workdir / f"store-{policy}.sqlite3")
    thread = ServerThread(state).start()
    try:
        with httpx.Client(base_url=thread.url, timeout=600) as client:
            for t in range(num_turns):
                progress(f"kv live {policy}: turn {t + 1}/{num_turns}")
                for s, turns in enumerate(sessions):
                    body = {"instructions": system, "input": turns[t], "max_output_tokens": 1, "temperature": 0,
                            "store": False, "prompt_cache_key": f"session-{s}"}
                    response = client.post("/v1/responses", json=body)
                    response.raise_for_status()
    finally:
        thread.stop()
        close_state(state)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    requests = load_requests(log)
    block_size = rows[0]["block_size"]
    predicted = replay(requests, ReplayConfig(
        block_size=block_size, capacity_tokens=num_kv_blocks * block_size, policy=policy,
        max_pinned_tokens=int(pin_share * num_kv_blocks) * block_size,
    ))
    prompt_tokens = sum(row["input_length"] for row in rows)
    return LiveComparison(policy, len(rows), prompt_tokens,
                          sum(row["cached_tokens"] for row in rows) / prompt_tokens, predicted.hit_rate)
