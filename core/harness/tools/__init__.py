"""Tools the agent calls: Python functions, MCP servers, the sandboxed shell and its approval policy."""
