"""``slimkv loadtest``: a closed-loop load generator for any OpenAI-compatible server."""
