"""Llama / Qwen2 decoder over a flat batch of tokens; attention is delegated to the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slimkv.model.gemm import Linear, linear

SUPPORTED_ARCHS = ("llama", "qwen2")
_SUPPORTED = ", ".join(SUPPORTED_ARCHS)
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

# attn(layer_idx, q [T, H, D], k [T, KV, D], v [T, KV, D]) -> [T, H, D]; q and k carry RoPE.
AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


@dataclass(slots=True, frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported arch {self.arch!r}; supported: {_SUPPORTED}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(f"rope_theta ({self.rope_theta}) and rms_norm_eps "
                             f"({self.rms_norm_eps}) must be positive")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        arch = cfg.get("model_type") or next(
            (_HF_ARCHITECTURES.get(a, a) for a in cfg.get("architectures") or []), None)
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model arch {arch!r} (architectures="
                             f"{cfg.get('architectures')}); supported: {_SUPPORTED}")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope scaling {rope_type!r} in {arch} config")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        if cfg.get("mlp_bias") or (arch == "llama" and cfg.get("attention_bias")):
            raise ValueError("unsupported llama variant with mlp_bias / attention_bias")
        if cfg.get("use_sliding_window"):
            raise ValueError("unsupported sliding-window attention (use_sliding_window=true)")
        heads = cfg["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like the reference implementation, scale in the weights' dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(args: ModelArgs) -> tuple[Tensor, Tensor]:
    """float32 cos/sin tables [max_position_embeddings, head_dim] (HF rotate_half layout)."""
    exponent = torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** exponent)
    freqs = torch.outer(torch.arange(args.max_position_embeddings).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = args.head_dim
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.split = [q_dim, kv_dim, kv_dim]
        self.wqkv = Linear(args.hidden_size, q_dim + 2 * kv_dim, bias=args.attention_bias,
                              dtype=dtype, device=device)
        self.wo = Linear(q_dim, args.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        T = x.shape[0]
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = apply_rope(q.view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)
        out = attn(self.layer_idx, q, k, v.view(T, self.num_kv_heads, self.head_dim))
        return self.wo(out.reshape(T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.w13 = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False,
                             dtype=dtype, device=device)
        self.w2 = Linear(args.intermediate_size, args.hidden_size, bias=False,
                            dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.attention = Attention(args, layer_idx, dtype, device)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.feed_forward = FeedForward(args, dtype, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.args = args
        # Random init as nn.Embedding does, except on meta (from_weights), where normal_ alone
        # costs ~1 s of load time because it imports torch._refs.
        embedding = torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=device)
        if embedding.device.type != "meta":
            embedding.normal_()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(
            TransformerBlock(args, i, dtype, device) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.output = None if args.tie_word_embeddings else Linear(
            args.hidden_size, args.vocab_size, bias=False, dtype=dtype, device=device)
        # Set by slimkv.model.lean.quantize_model: a quantized LM head, a float32 residual.
        self.lm_head: nn.Module | None = None
        self.residual_dtype: torch.dtype | None = None
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)
        self.requires_grad_(False)

    @classmethod
    def from_weights(cls, args: ModelArgs, weights: dict[str, Tensor], dtype: torch.dtype,
                     device: torch.device, strict: bool = True) -> Transformer:
        """Adopt ``weights`` (this module's state-dict names) without paying for random init;
        ``strict=False`` leaves the missing ones on the meta device for the caller to fill."""
        model = cls(args, dtype, torch.device("meta"))
        model.load_state_dict({k: w.to(device, dtype) for k, w in weights.items()}, assign=True,
                              strict=strict)
        cos, sin = rope_tables(args)
        model.rope_cos, model.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
        return model

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn,
                layers: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
        """Hidden states [T, hidden] after the final norm for a flat batch of T tokens.
        ``layers(input_ids, positions)``, when given, computes the residual after the last
        layer instead (the one-call decode step of slimkv.backends.cpu_step)."""
        if layers is not None:
            return self.norm(layers(input_ids, positions))
        x = self.tok_embeddings(input_ids)
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.lm_head is not None:
            return self.lm_head.fused(hidden)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return linear(hidden.to(weight.dtype), weight).float()
