"""The OpenAI-compatible server: ASGI app, schemas, metrics."""
