"""The real Codex CLI as a client of ``loopstack serve``: install the pinned release from npm, write
its provider config, run ``codex exec``.

Codex is OpenAI's coding agent; its Linux binary ships inside the npm registry package. This
module installs it once under ``.loopstack/codex`` (``make codex`` does the same), points it at a
server with a ``[model_providers.loopstack]`` entry (``wire_api = "responses"``, optionally
``supports_websockets``), and runs one non-interactive turn, returning Codex's own JSONL events::

    codex = CodexCLI.installed()            # or CodexCLI.install(), which runs npm
    run = codex.exec("Say hello.", base_url="http://127.0.0.1:8000/v1", websockets=True)
    run.final_message                       # the agent's last message
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CODEX_VERSION", "CodexCLI", "CodexRun", "CodexUnavailable", "provider_config"]

CODEX_VERSION = "0.169.0"
DEFAULT_PREFIX = Path(__file__).resolve().parents[2] / ".loopstack" / "codex"


class CodexUnavailable(RuntimeError):
    """The Codex CLI is not installed and cannot be (no npm, or the registry is unreachable)."""


def provider_config(base_url: str, *, model: str, websockets: bool = False, context_window: int | None = None,
                    auto_compact_tokens: int | None = None, instructions_file: Path | None = None) -> str:
    """A Codex ``config.toml`` that serves ``model`` from loopstack at ``base_url``.

    ``context_window`` / ``auto_compact_tokens`` are what Codex reads to size its history
    (``model_context_window``, ``model_auto_compact_token_limit``): without them it assumes a
    frontier model's window and never compacts before the server's context limit.
    ``instructions_file`` (``model_instructions_file``) replaces Codex's own ~3,800-token system
    prompt: how a small-context model fits the first request (``examples/codex/instructions.md``).
    """
    lines = [f"model = {json.dumps(model)}", 'model_provider = "loopstack"']
    if instructions_file is not None:
        lines.append(f"model_instructions_file = {json.dumps(str(instructions_file))}")
    if context_window:
        lines.append(f"model_context_window = {context_window}")
    if auto_compact_tokens:
        lines.append(f"model_auto_compact_token_limit = {auto_compact_tokens}")
    lines += [
        "", "[model_providers.loopstack]", 'name = "loopstack"', f"base_url = {json.dumps(base_url)}",
        'wire_api = "responses"', f"supports_websockets = {str(websockets).lower()}",
        "request_max_retries = 0", "stream_max_retries = 0",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class CodexRun:
    """One ``codex exec``: its exit status, JSONL events and stderr."""

    returncode: int
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""

    def items(self, kind: str) -> list[dict[str, Any]]:
        """Completed items of ``kind`` (``command_execution``, ``agent_message``, ``error``, ...)."""
        return [e["item"] for e in self.events if e.get("type") == "item.completed" and e["item"].get("type") == kind]

    @property
    def final_message(self) -> str | None:
        messages = self.items("agent_message")
        return messages[-1]["text"] if messages else None

    @property
    def turn_completed(self) -> bool:
        return any(e.get("type") == "turn.completed" for e in self.events)


@dataclass(frozen=True)
class CodexCLI:
    """An installed Codex CLI binary."""

    binary: Path

    @classmethod
    def installed(cls, prefix: Path = DEFAULT_PREFIX) -> CodexCLI | None:
        """The Codex under ``prefix`` (or ``$LOOPSTACK_CODEX``), if it is the pinned version."""
        override = os.environ.get("LOOPSTACK_CODEX")
        binary = Path(override) if override else prefix / "node_modules" / ".bin" / "codex"
        if not binary.exists():
            return None
        probe = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
        return cls(binary) if probe.returncode == 0 and CODEX_VERSION in probe.stdout else None

    @classmethod
    def install(cls, prefix: Path = DEFAULT_PREFIX, *, timeout: float = 600) -> CodexCLI:
        """The pinned Codex under ``prefix``, installed from npm if it is not there yet.

        Raises:
            CodexUnavailable: npm is missing or the install failed (the message has npm's error).
        """
        found = cls.installed(prefix)
        if found is not None:
            return found
        npm = shutil.which("npm")
        if npm is None:
            raise CodexUnavailable("npm is not on PATH: install Node.js and npm, then `make codex`")
        prefix.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                                   f"@openai/codex@{CODEX_VERSION}"], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CodexUnavailable(f"npm install @openai/codex@{CODEX_VERSION} took over {timeout:.0f} s") from None
        found = cls.installed(prefix)
        if done.returncode != 0 or found is None:
            raise CodexUnavailable(f"npm install @openai/codex@{CODEX_VERSION} failed: {done.stderr.strip()[-800:]}")
        return found

    def exec(self, prompt: str, *, base_url: str, model: str = "loopstack", websockets: bool = False,
             context_window: int | None = None, auto_compact_tokens: int | None = None,
             instructions: str | None = None, cwd: Path | None = None, timeout: float = 300,
             sandbox: str = "danger-full-access") -> CodexRun:
        """Run one ``codex exec`` turn against ``base_url`` in a fresh ``CODEX_HOME``.

        ``instructions`` replaces Codex's system prompt (see :func:`provider_config`).
        ``sandbox`` is Codex's ``-s``: the default runs its commands unsandboxed (containers
        often lack the user namespaces its bubblewrap sandbox needs); pass ``read-only`` where
        it works.
        """
        with tempfile.TemporaryDirectory(prefix="loopstack-codex-home-") as home:
            instructions_file = None
            if instructions is not None:
                instructions_file = Path(home, "instructions.md")
                instructions_file.write_text(instructions)
            Path(home, "config.toml").write_text(provider_config(
                base_url, model=model, websockets=websockets, context_window=context_window,
                auto_compact_tokens=auto_compact_tokens, instructions_file=instructions_file))
            env = {**os.environ, "CODEX_HOME": home, "NO_COLOR": "1"}
            env.pop("OPENAI_API_KEY", None)  # the provider entry has no env_key: nothing to send
            done = subprocess.run(
                [str(self.binary), "exec", "--skip-git-repo-check", "--json", "-s", sandbox, prompt],
                capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or home, stdin=subprocess.DEVNULL)
        events = []
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return CodexRun(done.returncode, events, done.stderr)
