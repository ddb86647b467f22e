"""The engine on a CUDA device (skipped without one; scripts/cuda_check.sh runs it on a lent
GPU): the Triton decode in every layer (``slimkv verify``), and the GPU engine's greedy
tokens against the CPU engine's on the same random checkpoint and KV format."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams
from slimkv.plugins import build_engine
from slimkv.verify import verify_dtype
from slimkv.workload import run_until_done

# Under TRITON_INTERPRET=1 Triton runs on CPU tensors only, so these tests need a process
# without it (scripts/cuda_check.sh runs this file in its own pytest process).
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                 reason="TRITON_INTERPRET=1 here: run in a process without it")]
PROMPTS = ["the quick brown fox", "over the lazy dog and the fox", "quick quick brown"]


def write_checkpoint(path: Path) -> Path:
    """A random 2-layer Llama (9 query heads over 3 KV heads, head_dim 64: SmolLM2's
    attention shape) with a byte-level BPE tokenizer, at ``path``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=320, hidden_size=576, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024))
    model.save_pretrained(path, safe_serialization=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"], vocab_size=300,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                            eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def config(path: Path, device: str, kv_dtype: str = "int8") -> Config:
    return Config.from_dict({"model": {"path": str(path), "device": device, "dtype": "float32"},
                             "kv_cache": {"dtype": kv_dtype, "memory_gb": 0.05}})


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_verify_takes_the_triton_decode_in_every_layer(checkpoint: Path, kv_dtype: str) -> None:
    report = verify_dtype(config(checkpoint, "cuda"), kv_dtype)
    assert report["ok"], report
    assert all(layer["paths"].get("triton_decode") for layer in report["layers"]), report


def test_gpu_engine_greedy_tokens_equal_the_cpu_engine(checkpoint: Path) -> None:
    """Float32 model, int8 KV on both devices: the same codes and scales in the pool, so
    the greedy tokens agree unless two logits tie within float rounding."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    tokens = {}
    for device in ("cuda", "cpu"):
        engine = build_engine(config(checkpoint, device))
        seqs = [engine.add_request(p, params) for p in PROMPTS]
        run_until_done(engine)
        tokens[device] = [s.output_token_ids for s in seqs]
    assert tokens["cuda"] == tokens["cpu"]
