"""Run shell commands for the model inside a working-directory jail.

What is enforced:

- **Working directory**: ``cwd`` must resolve (symlinks followed) inside ``root``, else
  :class:`SandboxViolation` and nothing runs.
- **Time**: each command runs in a new session (its own process group); on timeout the whole
  group gets SIGKILL. Leftover background processes of the group are killed after every run too.
  Where the PID namespace is available (see below) every process the command started dies with
  it, even one that called ``setsid`` to leave the group.
- **Output**: stdout and stderr share a budget of ``max_output_bytes``; reading keeps draining
  the pipes past it (so the command is not blocked) but stores nothing more, and marks the result
  ``truncated``. Memory stays bounded whatever the command prints.
- **Environment**: only ``PATH`` (a fixed system path), ``HOME`` (= root) and ``LANG``; secrets in
  the parent's environment do not reach the command. stdin is ``/dev/null``.
- **Network** (Linux, when ``unshare`` works for an unprivileged user): the command runs in
  fresh user, network and PID namespaces (``unshare --map-root-user --net --pid --fork
  --kill-child``), with no interface but a down loopback. Probed once per process and cached;
  where it does not work the command runs without, and ``ShellResult.network_isolated`` and
  :meth:`ShellSandbox.statistics` say so.

What is NOT enforced (this is a jail for the working directory, not a security boundary):

- File access: a command can read and write any absolute path the user can (``cat /etc/passwd``,
  ``echo x > /tmp/y``, ``cd /``). Only the *starting* directory is jailed. A real filesystem
  sandbox (bubblewrap, a container) is needed for that; it is not used here.
- Inside the user namespace the command appears as uid 0; that grants nothing outside it.
- The working directory is resolved before the command starts; a concurrent process swapping a
  path component for a symlink in between is not prevented.
- Without the PID namespace, a process that leaves the process group (``setsid``, double fork
  with a new session) survives the kill.
- CPU, memory and disk use are not limited (no rlimits/cgroups).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_UNSHARE_ARGS = ("unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")
_READ_CHUNK = 64 * 1024
_DRAIN_AFTER_KILL_S = 1.0


class SandboxViolation(Exception):
    """A command asked for a working directory outside the sandbox root (nothing ran)."""


@dataclass(frozen=True)
class ShellResult:
    """The outcome of one command.

    Attributes:
        exit_code: the shell's exit status; negative is the killing signal (``-9`` after a timeout).
        stdout, stderr: decoded output (UTF-8, invalid bytes replaced), within the byte budget.
        timed_out: the command ran past the timeout and its process group was killed.
        truncated: output past ``max_output_bytes`` was dropped.
        duration_s: wall time from start to exit.
        network_isolated: the command ran in its own empty network namespace.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_s: float
    network_isolated: bool


class ShellSandboxStatistics(NamedTuple):
    num_runs: int
    num_timeouts: int
    num_truncated: int
    num_violations: int
    num_output_bytes: int  # bytes read from the pipes, kept or dropped
    network_isolated: bool | None  # None until the first run has probed


@functools.cache
def network_isolation_works() -> bool:
    """Whether unprivileged user+net+pid namespaces work here (probed once per process)."""
    try:
        probe = subprocess.run([*_UNSHARE_ARGS, "/bin/true"], capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


class _OutputBudget:
    """Byte budget shared by stdout and stderr."""

    def __init__(self, max_bytes: int) -> None:
        self.bytes_left = max_bytes
        self.num_read = 0
        self.is_truncated = False

    async def read(self, stream: asyncio.StreamReader, into: bytearray) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            self.num_read += len(chunk)
            kept = chunk[: self.bytes_left]
            into += kept
            self.bytes_left -= len(kept)
            if len(kept) < len(chunk):
                self.is_truncated = True


class ShellSandbox:
    """Runs shell strings with ``/bin/sh -c`` in a jailed working directory (see module docs).

    Args:
        root: the jail; must be an existing directory.
        timeout_s: seconds before the process group is killed; ``None`` disables the limit.
        max_output_bytes: stdout + stderr bytes kept per command.
        allow_network: skip the network namespace (the default isolates where possible).

    Example::

        sandbox = ShellSandbox(Path("work"), timeout_s=30, max_output_bytes=32_768)
        result = await sandbox.run("ls -la", cwd="src")
    """

    def __init__(
        self, root: Path, *, timeout_s: float | None, max_output_bytes: int, allow_network: bool = False
    ) -> None:
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"sandbox root {self.root} is not a directory")
        if max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be >= 0, got {max_output_bytes}")
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.allow_network = allow_network
        self._num_runs = self._num_timeouts = self._num_truncated = self._num_violations = 0
        self._num_output_bytes = 0
        self._network_isolated: bool | None = None

    def resolve_cwd(self, cwd: str | Path = ".") -> Path:
        """The real directory ``cwd`` names (relative to root); :class:`SandboxViolation` outside it."""
        candidate = self.root / cwd  # an absolute cwd replaces root, then must still land inside
        try:
            resolved = candidate.resolve(strict=True)
        except (OSError, RuntimeError) as exc:  # missing, or a symlink loop
            self._num_violations += 1
            raise SandboxViolation(f"working directory {str(cwd)!r} does not exist in the sandbox") from exc
        if not resolved.is_relative_to(self.root) or not resolved.is_dir():
            self._num_violations += 1
            raise SandboxViolation(f"working directory {str(cwd)!r} resolves outside the sandbox root")
        return resolved

    def environment(self) -> dict[str, str]:
        """The whole environment a command sees."""
        return {"PATH": _SAFE_PATH, "HOME": str(self.root), "LANG": "C.UTF-8"}

    async def run(self, command: str, cwd: str | Path = ".", *, allow_network: bool | None = None) -> ShellResult:
        """Run ``command`` through ``/bin/sh -c`` in ``cwd`` (relative to root).

        Args:
            command: a shell string.
            cwd: working directory, must resolve inside root.
            allow_network: override the sandbox default for this command (an approved escalation).

        Returns:
            a :class:`ShellResult`; a failing or timed-out command is a result, not an error.

        Raises:
            SandboxViolation: ``cwd`` is missing or outside root; nothing ran.
        """
        workdir = self.resolve_cwd(cwd)
        allow = self.allow_network if allow_network is None else allow_network
        isolate = not allow and await asyncio.to_thread(network_isolation_works)
        if not allow:
            self._network_isolated = isolate
        argv = [*_UNSHARE_ARGS, "/bin/sh", "-c", command] if isolate else ["/bin/sh", "-c", command]
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env=self.environment(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        budget = _OutputBudget(self.max_output_bytes)
        stdout, stderr = bytearray(), bytearray()
        timed_out, exit_code = await self._wait(proc, budget, stdout, stderr)
        self._num_runs += 1
        self._num_timeouts += timed_out
        self._num_truncated += budget.is_truncated
        self._num_output_bytes += budget.num_read
        return ShellResult(
            exit_code=exit_code,
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr.decode("utf-8", errors="replace"),
            timed_out=timed_out,
            truncated=budget.is_truncated,
            duration_s=time.monotonic() - started,
            network_isolated=isolate,
        )

    async def _wait(
        self, proc: asyncio.subprocess.Process, budget: _OutputBudget, stdout: bytearray, stderr: bytearray
    ) -> tuple[bool, int]:
        assert proc.stdout is not None and proc.stderr is not None  # both are PIPE
        readers = asyncio.gather(budget.read(proc.stdout, stdout), budget.read(proc.stderr, stderr))
        timed_out = False
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.shield(readers)
                await proc.wait()
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # also reaps background leftovers of a finished command
            exit_code = await proc.wait()
            # Every writer is dead now, so the pipes reach EOF; a process that escaped the
            # group may still hold them, so stop waiting after a moment.
            try:
                await asyncio.wait_for(readers, _DRAIN_AFTER_KILL_S)
            except TimeoutError:
                pass
        return timed_out, exit_code

    def statistics(self) -> ShellSandboxStatistics:
        return ShellSandboxStatistics(
            num_runs=self._num_runs,
            num_timeouts=self._num_timeouts,
            num_truncated=self._num_truncated,
            num_violations=self._num_violations,
            num_output_bytes=self._num_output_bytes,
            network_isolated=self._network_isolated,
        )


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # group already empty
        pass
