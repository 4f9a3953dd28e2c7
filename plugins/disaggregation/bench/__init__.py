"""The ``disagg`` bench: colocated vs disaggregated serving on a mixed workload shaped by the Azure
LLM inference trace (:mod:`.workload`, :mod:`.trace`)."""
