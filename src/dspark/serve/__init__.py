"""`dspark serve`: the OpenAI-compatible HTTP server (app.py) over one engine loop owning the batch (batcher.py)."""
