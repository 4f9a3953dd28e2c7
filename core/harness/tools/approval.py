"""When a shell command needs a person's approval before it runs.

Policies (the ``[harness] approval`` value, named as in the agent CLIs):

- ``never``: run every command without asking (the sandbox is the only guard).
- ``on-request``: commands on the safe list run; anything else needs approval. The model may
  also ask for escalation (``escalate: true``, which grants network access for that one
  command); an escalated call always needs approval.
- ``untrusted``: the workspace itself is not trusted, so only the small read-only list runs
  without asking. ``git`` is left off that list: a repository's own config can make read-only
  git commands run programs (``core.fsmonitor``, ``core.pager``, ``diff.external``).

The safe list is deliberately narrow and the checks are conservative: a command that *might*
do more than read is treated as unsafe. Any shell metacharacter anywhere in the string (even
quoted) makes it unsafe, as do globs (expanded file names can inject options, e.g. a file
named ``-delete`` under ``find *``) and ``NAME=value`` prefixes (``GIT_EXTERNAL_DIFF=x git diff``).

Example::

    policy = ApprovalPolicy.from_config(stack.harness.approval)
    if needs_approval("rm -rf build", policy) and not await approver(request):
        ...  # denied: the command never runs
"""

from __future__ import annotations

import enum
import shlex
from dataclasses import dataclass
from typing import Protocol


class ApprovalPolicy(str, enum.Enum):
    NEVER = "never"
    ON_REQUEST = "on-request"
    UNTRUSTED = "untrusted"

    @classmethod
    def from_config(cls, value: str | ApprovalPolicy) -> ApprovalPolicy:
        """The policy for a ``[harness] approval`` value; ``ValueError`` names the valid ones."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"unknown approval policy {value!r}; expected one of {valid}") from None


@dataclass(frozen=True)
class ToolCallRequest:
    """What a person is asked to approve.

    Attributes:
        tool_name: the tool the model called ("shell").
        command: the shell string that would run.
        workdir: the working directory, relative to the sandbox root.
        is_escalated: the model asked for escalated permissions (network access).
    """

    tool_name: str
    command: str
    workdir: str = "."
    is_escalated: bool = False


class Approver(Protocol):
    """Decides one request: ``True`` runs it, ``False`` denies it. The CLI prompts a person."""

    async def __call__(self, request: ToolCallRequest) -> bool: ...


# Characters that make ``sh -c`` do more than run one simple command, plus globs and quoting
# tricks we refuse to reason about. Newlines separate commands just like ``;``.
SHELL_METACHARACTERS = frozenset(";|&><`$()\n\r*?[]{}\\~!#")

# Read-only commands, safe under every policy (flags checked by ``_UNSAFE_FLAGS``).
SAFE_COMMANDS = frozenset(
    {"ls", "cat", "head", "tail", "wc", "grep", "rg", "find", "pwd", "echo", "true", "stat", "du", "tree"}
)
# Read-only git subcommands: safe only when the workspace (its .git/config) is trusted.
SAFE_GIT_SUBCOMMANDS = frozenset({"status", "diff", "log", "show", "branch", "rev-parse", "ls-files"})

# Options that make an otherwise read-only command write files or run programs.
_UNSAFE_FLAGS: dict[str, tuple[str, ...]] = {
    "find": ("-exec", "-execdir", "-ok", "-okdir", "-delete", "-fprint", "-fprint0", "-fprintf", "-fls"),
    "rg": ("--pre", "--search-zip", "-z"),
    "git": ("--output", "--ext-diff", "--textconv", "-o", "--open-files-in-pager", "-O"),
    "tree": ("-o",),
}
_UNSAFE_GIT_BRANCH_FLAGS = (
    "-d", "-D", "-m", "-M", "-c", "-C", "-u", "--delete", "--move", "--copy", "--set-upstream-to", "--edit-description",
)


def needs_approval(command: list[str] | str, policy: ApprovalPolicy | str, *, is_escalated: bool = False) -> bool:
    """Whether ``command`` must be approved before it runs under ``policy``.

    Args:
        command: a shell string, or an argv list (joined with :func:`shlex.join` first).
        policy: an :class:`ApprovalPolicy` or its config value.
        is_escalated: the model asked for escalated permissions.

    Returns:
        ``False`` only under ``never``, or for a command on the safe list (and not escalated).
    """
    policy = ApprovalPolicy.from_config(policy)
    if policy is ApprovalPolicy.NEVER:
        return False
    if is_escalated:
        return True
    return not is_safe_command(command, allow_git=policy is ApprovalPolicy.ON_REQUEST)


def is_safe_command(command: list[str] | str, *, allow_git: bool = False) -> bool:
    """Whether ``command`` is one simple, read-only command from the safe list."""
    text = shlex.join(command) if isinstance(command, list) else command
    if not text.strip() or any(ch in SHELL_METACHARACTERS for ch in text):
        return False
    try:
        argv = shlex.split(text)
    except ValueError:  # unbalanced quotes: sh would disagree with us, so refuse
        return False
    program, args = argv[0], argv[1:]
    if "=" in program or "/" in program:  # env prefix, or a path that may not be the real tool
        return False
    if program == "git":
        return allow_git and _is_safe_git(args)
    if program not in SAFE_COMMANDS:
        return False
    return not _has_unsafe_flag(program, args)


def _is_safe_git(args: list[str]) -> bool:
    # ``git -c k=v`` / ``--exec-path`` etc. come before the subcommand: refuse any global option.
    if not args or args[0] not in SAFE_GIT_SUBCOMMANDS:
        return False
    # ``git branch`` lists only: a positional argument creates a branch.
    if args[0] == "branch":
        branch_args = args[1:]
        if any(not a.startswith("-") or a.split("=")[0] in _UNSAFE_GIT_BRANCH_FLAGS for a in branch_args):
            return False
    return not _has_unsafe_flag("git", args[1:])


def _has_unsafe_flag(program: str, args: list[str]) -> bool:
    unsafe = _UNSAFE_FLAGS.get(program, ())
    return any(arg.split("=", 1)[0] in unsafe for arg in args)
