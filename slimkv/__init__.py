"""slimkv: an LLM serving engine with a paged, quantized KV cache."""

# The tools' config sections register with Config here, so that every config loaded in any
# process knows them (importing any slimkv module runs this file first).
from slimkv.cluster import config as _cluster_section  # noqa: F401  (cluster)
from slimkv.server import config as _server_sections  # noqa: F401  (server, canary)
from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Config", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it only when asked for.
    if name == "LLM":
        from slimkv.llm import LLM
        return LLM
    raise AttributeError(name)
