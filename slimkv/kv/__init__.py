"""The paged KV cache: element formats (codecs), the preallocated pool, the staging
blocks, and the block bookkeeping (pool, manager)."""
