"""Model clients: what the agent loop calls the model through (HTTP, WebSocket, Chat Completions, embedded, replay)."""
