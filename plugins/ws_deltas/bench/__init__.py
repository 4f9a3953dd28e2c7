"""The ws_deltas benchmark: its workload, datasets and test doubles (not imported at run time)."""
