"""``kv_cache.int4.rotate_v`` folded into dense weights at load (issue 46).

Rotating V per kv head (v' = v R, R the orthonormal Hadamard of
:func:`slimkv.attention.backend.hadamard`) and the attention output back (o = o' R^T) is
linear on both sides of the attention, so for float weights it costs nothing at run time:
W_v's output rows of each kv head become R^T W_v (its bias b R) and W_o's input columns of
each query head W_o R (GQA: one R for every head, so the query heads sharing a kv head see
the same rotated values). Quantized weights (Q4_1 / int8 blocks) would have to be quantized
again, which changes the model, so there the attention rotates online instead
(:class:`slimkv.attention.layer.PagedAttention`); so do dense models for ``rotate_k``, which
RoPE keeps out of the weights.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from slimkv.attention.backend import hadamard
from slimkv.config import KVCacheConfig
from slimkv.kv.layers import layer_dtype_names
from slimkv.model.llama import Transformer, TransformerBlock


def rotated_for(model: Transformer, kv: KVCacheConfig) -> Transformer:
    """``model``, or its copy with V's rotation folded in where ``kv`` asks for it: in each
    layer whose V is int4 (``kv_cache.dtype``/``v_dtype``, ``layer_dtypes``)."""
    if not kv.int4.rotate_v:
        return model
    names = layer_dtype_names(model.args.num_layers, "", kv.v_dtype or kv.dtype, kv.layer_dtypes)
    return fold_v_rotation(model, [i for i, (_, v) in enumerate(names) if v == "int4"]) or model


def fold_v_rotation(model: Transformer, layers: list[int]) -> Transformer | None:
    """A copy of ``model`` (sharing every tensor but the changed ones; the loader's models
    are cached and must not change) with V's rotation in the weights of ``layers``, marked
    ``v_rotated`` for the runner; None when its layers are not dense (quantized weights)."""
    if not all(isinstance(block, TransformerBlock) for block in model.layers):
        return None
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    folded = copy.deepcopy(model, shared)
    for i in layers:
        a = folded.layers[i].attention
        rot = hadamard(a.head_dim, torch.device("cpu")).double()  # [D, D], symmetric
        q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        w = a.wqkv.weight.detach().double().clone()  # [q + 2 kv, hidden]
        v_rows = w[q_dim + kv_dim:].unflatten(0, (a.num_kv_heads, a.head_dim))  # [H, D, hidden]
        w[q_dim + kv_dim:] = (rot.T.to(w.device) @ v_rows).flatten(0, 1)
        a.wqkv.weight = _param(w, a.wqkv.weight)
        if a.wqkv.bias is not None:
            b = a.wqkv.bias.detach().double().clone()
            v_bias = b[q_dim + kv_dim:].view(-1, a.head_dim)  # [H, D]
            b[q_dim + kv_dim:] = (v_bias @ rot.to(b.device)).flatten()
            a.wqkv.bias = _param(b, a.wqkv.bias)
        wo = a.wo.weight.detach().double().unflatten(1, (a.num_heads, a.head_dim))
        # [hidden, Hq, D]
        a.wo.weight = _param((wo @ rot.to(wo.device)).flatten(1), a.wo.weight)
    folded.v_rotated = True
    return folded


def _param(value: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value.to(like.dtype).contiguous(), requires_grad=False)
