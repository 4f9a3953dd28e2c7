"""The HTTP and WebSocket routes of the API server: thin adapters over :func:`loopstack.api.pipeline.respond`."""
