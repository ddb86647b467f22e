"""slimkv: an LLM serving engine with a paged, quantized KV cache."""

from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Config", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it only when asked for.
    if name == "LLM":
        from slimkv.llm import LLM
        return LLM
    raise AttributeError(name)
