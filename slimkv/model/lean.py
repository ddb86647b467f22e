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
        a = self.attention
        # Plain references for forward (nn.Module's __getattr__ costs ~0.2 ms a step).
        self.__dict__["_parts"] = (a.wqkv, a.wo, block.feed_forward.w13, block.feed_forward.w2,
                                   self.attention_norm, self.ffn_norm, a.layer_idx, a.head_dim,
                                   a.num_heads, a.num_heads + a.num_kv_heads)

    @property
    def parts(self) -> tuple:
        """(wqkv, wo, w13, w2, attention_norm, ffn_norm, layer index, head_dim, q heads,
        q + kv heads): what the one-call decode step (slimkv.backends.cpu_step) reads."""
        return self._parts

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        """``x [T, hidden]`` float32, updated in place and returned; ``cos``, ``sin``
        float32 ``[T, 1, head_dim]`` (the model's tables are float32 once quantized)."""
        wqkv, wo, w13, w2, attention_norm, ffn_norm, layer, head_dim, hq, hqk = self._parts
        qkv = wqkv.fused(x, RMSNORM, attention_norm, keep=True)
        wqkv.kernel.rope(qkv, hqk, head_dim, cos, sin)
        # float32 views (bfloat16 from a GEMM): the attention rounds them to the model dtype
        heads = qkv.view(x.shape[0], -1, head_dim)
        out = attn(layer, heads[:, :hq], heads[:, hq:hqk], heads[:, hqk:])
        wo.fused(out.reshape(x.shape[0], -1), out=x)
        w2.fused(w13.fused(x, RMSNORM, ffn_norm, keep=True), SILU_MUL, out=x)
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
