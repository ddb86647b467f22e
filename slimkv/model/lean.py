"""A decoder whose linear layers are quantized (:mod:`slimkv.model.quant`), and its lean layer.

:func:`quantize_model` swaps a float ``Transformer``'s projections for ``QuantLinear``
modules and each block for a :class:`QuantBlock`, whose forward keeps the residual stream
in float32 and lets the matmul kernel do what sits around each matmul: RMSNorm on the way
into the QKV and gate/up projections, SiLU(gate) * up on the way into the down
projection, and the residual add on the way out of the output and down projections. A
layer is then four kernel calls, RoPE and attention, instead of ~25 ATen ops.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimkv.kernels.qgemm import RMSNORM, SILU_MUL
from slimkv.model.llama import AttentionFn, Transformer, TransformerBlock, rope_tables
from slimkv.model.quant import QuantEmbedding, QuantLinear, QuantTensor

# The projections of a block, by their state-dict names under ``layers.N.``.
LAYER_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


class QuantBlock(nn.Module):
    """A ``TransformerBlock``'s modules with quantized projections; see the module doc."""

    def __init__(self, block: TransformerBlock) -> None:
        super().__init__()
        self.attention_norm, self.attention = block.attention_norm, block.attention
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward
        for norm in (self.attention_norm, self.ffn_norm):  # read by the kernel only
            norm.weight.data = norm.weight.data.float()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        """``x [T, hidden]`` float32, updated in place and returned; ``cos``, ``sin``
        float32 ``[T, 1, head_dim]`` (the model's tables are float32 once quantized)."""
        a, f = self.attention, self.feed_forward
        T = x.shape[0]
        qkv = a.wqkv.fused(x, RMSNORM, self.attention_norm)
        a.wqkv.kernel.rope(qkv, a.num_heads + a.num_kv_heads, a.head_dim, cos, sin)
        # float32 views: the attention rounds them to the model dtype (in its kernel)
        q, k, v = (t.view(T, -1, a.head_dim) for t in qkv.split(a.split, dim=-1))
        out = attn(a.layer_idx, q, k, v)
        a.wo.fused(out.reshape(T, -1), out=x)
        f.w2.fused(f.w13.fused(x, RMSNORM, self.ffn_norm), SILU_MUL, out=x)
        return x


def set_activations(model: nn.Module, precise: bool) -> None:
    """``model.activations``: PRECISE (int8 + int8 residual, ~15 bits) or plain int8
    activations in every quantized projection's kernel."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.precise = precise


def quantize_model(model: Transformer, weights: dict[str, QuantTensor],
                   dtype: torch.dtype) -> Transformer:
    """Adopt ``weights`` (state-dict names without ``.weight``: every block's projections,
    and optionally ``tok_embeddings`` / ``output``) into ``model``, in place."""
    for i, block in enumerate(model.layers):
        for name in LAYER_LINEARS:
            parent, _, attr = name.rpartition(".")
            owner = block.get_submodule(parent)
            bias = getattr(owner, attr).bias
            setattr(owner, attr, QuantLinear(weights[f"layers.{i}.{name}"], dtype,
                                             None if bias is None or bias.is_meta else bias))
        model.layers[i] = QuantBlock(block)
    if "tok_embeddings" in weights:
        model.tok_embeddings = QuantEmbedding(weights["tok_embeddings"], dtype)
        if model.output is None:
            model.lm_head = model.tok_embeddings.table
    if "output" in weights:
        model.output = QuantLinear(weights["output"], dtype)
        model.lm_head = model.output
    model.residual_dtype = torch.float32
    model.rope_cos, model.rope_sin = (t.float() for t in rope_tables(model.args))
    return model
