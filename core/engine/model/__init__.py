"""The model: a Llama-family decoder over a paged KV cache, its attention, quantized linears and the native decode loop."""
