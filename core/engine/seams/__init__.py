"""The places the inference plugins will drive: replica processes, KV events, KV transfer, speculative
verification. No plugin drives them yet (routing, speculative decoding and disaggregation are declared,
not built); today only tests use them."""
