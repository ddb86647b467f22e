"""``slimkv bench simulate``: the real scheduler, KV manager and block pool on a simulated
clock, with a step-time model per device instead of a model forward (Vidur's method on our
own code). See docs/capacity.md."""
