"""The ``spec`` bench: decode speed and acceptance, plugin off vs each proposer (see :mod:`.workload`)."""
