"""Escapes tried against ShellSandbox and contained; the shell tool's result text."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from pathlib import Path

import pytest

from loopstack.harness.tools.sandbox import (
    SandboxViolation,
    ShellResult,
    ShellSandbox,
    network_isolation_works,
)
from loopstack.harness.tools.shell import ShellTool

# allow_network=True runs without namespaces: the plain process-group path.
ISOLATION_MODES = [pytest.param(False, id="namespaces-if-available"), pytest.param(True, id="process-group-only")]


def _sandbox(root: Path, **overrides: object) -> ShellSandbox:
    options: dict[str, object] = {"timeout_s": 5.0, "max_output_bytes": 4096} | overrides
    return ShellSandbox(root, **options)  # type: ignore[arg-type]


def _run(sandbox: ShellSandbox, command: str, cwd: str = ".") -> ShellResult:
    return asyncio.run(sandbox.run(command, cwd))


def _processes_with(marker: str, *, settle_s: float = 2.0) -> list[int]:
    """Live processes whose argv contains ``marker``; waits up to ``settle_s`` for SIGKILLed ones to exit."""
    deadline = time.monotonic() + settle_s
    while True:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # exited while we looked
                pass
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.01)


def test_runs_in_the_root_with_the_exit_code(tmp_path: Path) -> None:
    result = _run(_sandbox(tmp_path), "pwd; echo oops >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, f"{tmp_path.resolve()}\n", "oops\n")
    assert not result.timed_out and not result.truncated


def test_subdirectory_cwd(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    assert _run(_sandbox(tmp_path), "pwd", "src").stdout.strip() == str((tmp_path / "src").resolve())


@pytest.mark.parametrize("cwd", ["..", "../..", "src/../../..", "/", "/etc", "missing"])
def test_cwd_outside_root_is_a_violation(tmp_path: Path, cwd: str) -> None:
    root = tmp_path / "root"
    (root / "src").mkdir(parents=True)
    sandbox = _sandbox(root)
    with pytest.raises(SandboxViolation):
        _run(sandbox, "touch escaped", cwd)
    assert not (tmp_path / "escaped").exists()
    assert sandbox.statistics().num_violations == 1 and sandbox.statistics().num_runs == 0


def test_symlink_pointing_outside_is_a_violation(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(SandboxViolation):
        _run(_sandbox(root), "touch escaped", "link")
    assert list(outside.iterdir()) == []


def test_symlink_inside_root_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert _run(_sandbox(tmp_path), "pwd", "link").stdout.strip() == str((tmp_path / "real").resolve())


@pytest.mark.parametrize("allow_network", ISOLATION_MODES)
def test_timeout_kills_the_whole_process_group(tmp_path: Path, allow_network: bool) -> None:
    marker = f"{30 + uuid.uuid4().int % 1000 / 1000:.3f}"  # a unique `sleep` argument to find leftovers by
    sandbox = _sandbox(tmp_path, timeout_s=0.5, allow_network=allow_network)
    started = time.monotonic()
    result = _run(sandbox, f"sleep {marker} & sleep {marker}; echo never")
    assert result.timed_out and result.exit_code < 0 and "never" not in result.stdout
    assert time.monotonic() - started < 3
    assert _processes_with(f"sleep\x00{marker}") == []
    assert sandbox.statistics().num_timeouts == 1


@pytest.mark.parametrize("allow_network", ISOLATION_MODES)
def test_background_leftovers_are_killed_after_a_normal_exit(tmp_path: Path, allow_network: bool) -> None:
    marker = f"{30 + uuid.uuid4().int % 1000 / 1000:.3f}"
    result = _run(_sandbox(tmp_path, allow_network=allow_network), f"sleep {marker} >/dev/null 2>&1 & echo done")
    assert result.stdout == "done\n" and not result.timed_out
    assert _processes_with(f"sleep\x00{marker}") == []


def test_huge_output_is_capped_while_reading(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path, max_output_bytes=1000)
    result = _run(sandbox, "yes | head -c 50000000")
    assert result.truncated and len(result.stdout) == 1000 and result.exit_code == 0
    assert result.duration_s < 5
    assert sandbox.statistics().num_output_bytes == 50_000_000


def test_budget_is_shared_by_stdout_and_stderr(tmp_path: Path) -> None:
    result = _run(_sandbox(tmp_path, max_output_bytes=300), "head -c 200 /dev/zero; head -c 200 /dev/zero >&2")
    assert result.truncated and len(result.stdout) + len(result.stderr) == 300


def test_parent_environment_does_not_leak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPSTACK_TEST_SECRET", "hunter2")
    result = _run(_sandbox(tmp_path), "env; echo \"[$LOOPSTACK_TEST_SECRET]\"")
    assert "hunter2" not in result.stdout and "[]" in result.stdout
    names = {line.split("=", 1)[0] for line in result.stdout.splitlines() if "=" in line}
    assert names <= {"PATH", "HOME", "LANG", "PWD"}  # PWD is set by sh itself
    assert f"HOME={tmp_path.resolve()}" in result.stdout


def _requires_namespaces() -> None:
    if not network_isolation_works():
        pytest.skip("unshare --map-root-user --net --pid is not permitted here (no unprivileged user namespaces)")


def test_network_namespace_has_only_loopback(tmp_path: Path) -> None:
    _requires_namespaces()
    sandbox = _sandbox(tmp_path)
    result = _run(sandbox, "cat /proc/net/dev")  # per network namespace: lists its interfaces
    interfaces = {line.split(":")[0].strip() for line in result.stdout.splitlines() if ":" in line}
    assert result.network_isolated and interfaces == {"lo"}
    assert sandbox.statistics().network_isolated is True


def test_parent_loopback_server_is_unreachable(tmp_path: Path) -> None:
    _requires_namespaces()
    if not Path("/usr/bin/python3").exists():
        pytest.skip("needs /usr/bin/python3 inside the sandbox to open a socket")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        isolated = _run(_sandbox(tmp_path), f"python3 -c \"{probe}\"")
        allowed = _run(_sandbox(tmp_path, allow_network=True), f"python3 -c \"{probe}\"")
    assert isolated.exit_code != 0 and "connected" not in isolated.stdout
    assert allowed.stdout == "connected\n" and not allowed.network_isolated


def test_pid_namespace_kills_a_process_that_left_the_group(tmp_path: Path) -> None:
    _requires_namespaces()
    marker = f"{30 + uuid.uuid4().int % 1000 / 1000:.3f}"
    result = _run(_sandbox(tmp_path), f"setsid sleep {marker} >/dev/null 2>&1 & echo started")
    assert result.stdout == "started\n"
    assert _processes_with(f"sleep\x00{marker}") == []


def test_process_group_mode_reports_no_network_isolation(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path, allow_network=True)
    assert not _run(sandbox, "true").network_isolated


def test_tool_result_marks_timeout_and_truncation(tmp_path: Path) -> None:
    tool = ShellTool(_sandbox(tmp_path, timeout_s=0.5, max_output_bytes=300), "never")
    text = asyncio.run(tool.call({"command": "head -c 1000 /dev/zero | tr '\\0' x; sleep 10"})).text
    assert text.startswith("exit_code: -9") and "[timed out" in text and "[output truncated" in text
    assert "x" * 300 in text and "x" * 301 not in text


def test_tool_reports_bad_workdir_and_bad_arguments_as_results(tmp_path: Path) -> None:
    tool = ShellTool(_sandbox(tmp_path), "never")
    outside = asyncio.run(tool.call({"command": "touch x", "workdir": "../.."}))
    invalid = asyncio.run(tool.call({"cmd": "ls"}))
    assert outside.is_error and "outside" in outside.text
    assert invalid.is_error and "invalid arguments" in invalid.text
    assert tool.statistics().num_invalid == 2


def test_tool_schema(tmp_path: Path) -> None:
    info = ShellTool(_sandbox(tmp_path), "never").info
    assert info.name == "shell" and info.parameters["required"] == ["command"]
    assert set(info.parameters["properties"]) == {"command", "workdir", "escalate"}
