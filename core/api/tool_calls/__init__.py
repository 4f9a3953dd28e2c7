"""Tool calls in and out of the model: the grammars that enforce ``tool_choice`` and the stream parser."""
