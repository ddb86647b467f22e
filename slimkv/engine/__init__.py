"""The engine layer: requests in, steps, outputs out.

Bottom-up: ``sequence`` (one request's bookkeeping), ``sampling_params`` / ``sampling`` /
``choices`` / ``outputs``, ``scheduler`` (continuous batching, admission), ``memory``
(where memory goes), ``runner`` (one batched forward and sampling), ``llm_engine``
(``LLMEngine``) and ``engine_stats`` (the snapshot the server reads). This package's
``__init__`` imports nothing, so the block bookkeeping stays torch-free.
"""
