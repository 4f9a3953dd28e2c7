"""The places the inference plugins drive: replica processes and KV events (``cache_routing``, through
the router), the proposer contract (``spec_decode``; verification itself is the engine step's,
:mod:`loopstack.engine.speculator`), and KV transfer (disaggregation: declared, not built; only tests
use it today)."""
