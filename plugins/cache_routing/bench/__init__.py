"""The ``routing`` bench: the Mooncake trace replayed against modelled replicas (``replay``), and
its workload (``workload``)."""
