"""A second KV tier below the pool: chunks of full blocks in host memory and on disk,
loaded instead of recomputed (see :mod:`slimkv.kv.offload.tier`)."""
