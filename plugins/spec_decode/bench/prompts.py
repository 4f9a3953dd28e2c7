"""The ``spec`` bench's requests: agent-shaped ones built from real SWE-bench agent runs, and open chat.

Agent-shaped (``../shared/data/trajectories/swebench_minisweagent/full_trajectories``, five real
mini-swe-agent runs): the outputs an agent loop asks a model for again and again.

- ``rewrite``: a file the agent ``cat``-ed, to be written back whole with one small edit;
- ``tool_repeat``: a tool output (grep, ls, test run), to be repeated with one line changed;
- ``recurring``: a session asking, turn after turn, for an answer close to an earlier one that
  is no longer in the prompt (a retry, a re-plan): only a global index of past outputs can help.

Open chat: the questions, chit-chat and long requests of the everyday set the safety guard is
judged on (``plugins/parallel_safety/bench/everyday.jsonl``), nothing copied from a prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SpecPrompt", "agent_prompts", "chat_prompts", "trajectory_dir"]

EVERYDAY = Path(__file__).resolve().parents[2] / "parallel_safety" / "bench" / "everyday.jsonl"
SYSTEM = "You are a careful coding assistant."


@dataclass(frozen=True)
class SpecPrompt:
    kind: str  # rewrite | tool_repeat | recurring | chat
    messages: list[dict[str, str]]
    session: str = ""  # requests of one session run in order (recurring)


def trajectory_dir(data_dir: Path) -> Path:
    return data_dir / "trajectories" / "swebench_minisweagent" / "full_trajectories"


def _observations(data_dir: Path) -> list[tuple[str, str]]:
    """(command, output) of every tool call in the five full trajectories."""
    pairs = []
    for path in sorted(trajectory_dir(data_dir).glob("*.traj.json")):
        messages = json.loads(path.read_text())["messages"]
        for assistant, tool in zip(messages, messages[1:]):
            if assistant["role"] != "assistant" or tool["role"] != "user":
                continue
            command = re.search(r"```bash\n(.*?)\n```", _text(assistant), re.S)
            output = re.search(r"<output>\n(.*?)</output>", _text(tool), re.S)
            if command and output and output.group(1).strip():
                pairs.append((command.group(1).strip(), output.group(1)))
    return pairs


def _text(message: dict[str, Any]) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def _edit(text: str) -> tuple[str, str] | None:
    """One small edit to ask for: rename an identifier that occurs in ``text``."""
    names = re.findall(r"\bdef ([a-z_][a-z0-9_]{3,})\(", text) or re.findall(r"\b([a-z_]{5,}[a-z0-9_]*)\b", text)
    if not names:
        return None
    name = names[0]
    return name, f"{name}_v2"


def agent_prompts(data_dir: Path, *, per_kind: int = 4, max_chars: int = 1800, min_chars: int = 300) -> list[SpecPrompt]:
    """``per_kind`` requests of each agent shape (see the module docstring), deterministic."""
    observations = _observations(data_dir)
    files = [(c, o) for c, o in observations if c.startswith(("cat ", "sed -n", "head ")) and min_chars <= len(o) <= max_chars]
    tools = [(c, o) for c, o in observations if not c.startswith(("cat ", "sed -n", "head "))
             and min_chars <= len(o) <= max_chars]
    prompts: list[SpecPrompt] = []
    for command, output in files:
        edit = _edit(output)
        if edit is None:
            continue
        old, new = edit
        prompts.append(SpecPrompt("rewrite", [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Here is the output of `{command}`:\n\n{output}\n"
                                        f"Write the whole file again with `{old}` renamed to `{new}`. "
                                        "Output only the file."}]))
        if len([p for p in prompts if p.kind == "rewrite"]) == per_kind:
            break
    for command, output in tools[:per_kind]:
        lines = output.splitlines()
        target = lines[len(lines) // 2] if lines else ""
        prompts.append(SpecPrompt("tool_repeat", [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"`{command}` printed:\n\n{output}\n"
                                        f"Repeat this output exactly, but leave out the line `{target.strip()}`."}]))
    for session, (command, output) in enumerate(files[per_kind : per_kind + max(1, per_kind // 2)]):
        for turn, ask in enumerate(("Summarise what this file does, then list its functions.",
                                    "Again: summarise what this file does, then list its functions.")):
            prompts.append(SpecPrompt("recurring", [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"`{command}`:\n\n{output}\n{ask}"}], session=f"s{session}-{turn}"))
    return prompts


def chat_prompts(count: int = 12) -> list[SpecPrompt]:
    """Open chat requests from the everyday set: questions, chit-chat, long requests."""
    rows = [json.loads(line) for line in EVERYDAY.read_text().splitlines() if line.strip()]
    chosen = [r for r in rows if r.get("kind") in ("question", "long_request", "chit_chat")]
    step = max(1, len(chosen) // count)
    return [SpecPrompt("chat", [{"role": "user", "content": r["text"]}]) for r in chosen[::step][:count]]
