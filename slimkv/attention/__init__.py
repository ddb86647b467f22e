"""Attention over the paged pool: ``metadata`` (one step's plan), ``prefill`` (a chunk in
pieces) and ``paged`` (``PagedAttention``: cache write, decode and prefill paths, and the
reference oracle)."""
