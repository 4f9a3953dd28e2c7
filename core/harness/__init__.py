"""The agent harness: tool execution around the kernel (shell tool, approval policy, sandbox)."""

from __future__ import annotations
