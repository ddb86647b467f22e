"""Attention over the paged pool: ``metadata`` (one step's plan, built once), ``prefill`` (a
chunk in SDPA pieces), the backends (``cpu``, ``triton``, ``sdpa``, ``reference``, over the
shared write of ``backend``) and ``layer`` (``PagedAttention``: the backend chosen once, and
the paths it takes)."""
