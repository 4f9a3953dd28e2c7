"""The code_mode benchmark: its workload, datasets and test doubles (not imported at run time)."""
