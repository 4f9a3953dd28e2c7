"""The places the inference plugins drive: replica processes, KV events, KV transfer, speculative verification."""
