"""Stack files: TOML -> a validated :class:`~loopstack.stack.schema.ResolvedStack`, with errors that name file, key and line."""
