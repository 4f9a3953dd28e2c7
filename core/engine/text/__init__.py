"""Text in and out of the engine: the tokenizer and chat templates, and grammar-constrained decoding."""
