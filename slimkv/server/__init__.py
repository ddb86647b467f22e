"""OpenAI-compatible HTTP server with Prometheus metrics (``slimkv serve``)."""
