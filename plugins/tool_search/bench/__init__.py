"""The tool_search benchmark: its workload, datasets and test doubles (not imported at run time)."""
