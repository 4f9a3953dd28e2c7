"""The parallel_safety benchmark: its workload, datasets and test doubles (not imported at run time)."""
