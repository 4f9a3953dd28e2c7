"""The search index of deferred tools: fielded BM25, MiniLM embeddings (a plain-torch BERT), their fusion,
the vectors kept on disk, and learning from use."""
