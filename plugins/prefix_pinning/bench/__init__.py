"""The prefix_pinning benchmark: its workload, datasets and test doubles (not imported at run time)."""
