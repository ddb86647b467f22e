"""Which precision class each weight is held in: float, or a group-32 quantized class.

``WEIGHT_CLASSES``: ``float`` (everything in the model dtype), ``file`` (keep the GGUF's
Q4_0/Q4_1/Q8_0 blocks as they are; float files stay float), ``int4`` / ``int8`` (every
projection, the embedding and the LM head in that class: from the file's blocks where they
already are in it, 4 -> 8 bits exactly, else quantized min/max per group of 32).
:func:`resolve_weights` picks one for ``model.weights``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimkv.config import ConfigError
from slimkv.kernels.qgemm import qgemm_native, qgemm_unavailable_reason
from slimkv.model.lean import LAYER_LINEARS, quantize_model
from slimkv.model.llama import ModelArgs, Transformer
from slimkv.model.quant import QuantTensor
from slimkv.model_io.convert import cat_rows, quantize, to_bits

WEIGHT_CLASSES = ("float", "file", "int4", "int8")
Weight = Tensor | QuantTensor


def resolve_weights(config_weights: str, config_dtype: str, device: torch.device) -> str:
    """``model.weights`` as one of :data:`WEIGHT_CLASSES`: ``auto`` keeps the file's 4/8-bit
    blocks where the CPU kernel runs natively and the model dtype is not pinned; quantized
    classes need the CPU kernel."""
    if config_weights in ("int4", "int8"):
        reason = (f"the device is {device}" if device.type != "cpu" else
                  qgemm_unavailable_reason())
        if reason:
            raise ConfigError(f"model.weights={config_weights} needs the CPU weight kernel "
                              f"(slimkv/kernels/qgemm.c): {reason}")
        return config_weights
    if config_weights == "auto" and config_dtype == "auto" and device.type == "cpu" \
            and qgemm_native():
        return "file"
    return "float"


def cat(parts: list[Weight]) -> Weight:
    """Stack projections along N; a mix of float and quantized parts becomes float."""
    if all(isinstance(p, QuantTensor) for p in parts):
        return cat_rows(parts)
    return torch.cat([p.dequantize() if isinstance(p, QuantTensor) else p for p in parts])


def _quantizable(args: ModelArgs) -> list[str]:
    names = [f"layers.{i}.{n}" for i in range(args.num_layers) for n in LAYER_LINEARS]
    return names + ["tok_embeddings", "output"]


def _convert(w: Weight, klass: str, bits: int | None) -> Weight:
    if klass == "float":
        return w.dequantize() if isinstance(w, QuantTensor) else w
    if isinstance(w, QuantTensor):
        return w if bits is None else to_bits(w, bits)
    return w if bits is None else quantize(w, bits)


def split_classes(args: ModelArgs, weights: dict[str, Weight],
                  klass: str) -> tuple[dict[str, Tensor], dict[str, QuantTensor]]:
    """(float state dict, quantized weights by module name) for ``klass``. ``file`` keeps
    the layers quantized only if every projection is (one class for the whole stack)."""
    if klass not in WEIGHT_CLASSES:
        raise ValueError(f"unknown weight class {klass!r}; choose one of {WEIGHT_CLASSES}")
    bits = {"int4": 4, "int8": 8}.get(klass)
    names = [n for n in _quantizable(args) if f"{n}.weight" in weights]
    layers = [n for n in names if n.startswith("layers.")]
    if klass == "file" and not all(isinstance(weights[f"{n}.weight"], QuantTensor) for n in layers):
        klass = "float"
    floats, quants = {}, {}
    for key, w in weights.items():
        name = key.removesuffix(".weight")
        w = _convert(w, "float" if name not in names else klass, bits)
        if isinstance(w, QuantTensor):
            quants[name] = w
        else:
            floats[key] = w
    return floats, quants


def build(args: ModelArgs, weights: dict[str, Weight], dtype: torch.dtype,
          device: torch.device, klass: str) -> Transformer:
    """The model with its weights in ``klass`` (quantized classes: CPU only)."""
    floats, quants = split_classes(args, weights, klass)
    if not quants:
        return Transformer.from_weights(args, floats, dtype, device)
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantized weights ({klass}) run on the CPU kernel only, not {device}")
    model = Transformer.from_weights(args, floats, dtype, device, strict=False)
    quantize_model(model, quants, dtype)
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"weights missing after loading: {missing[:5]}")
    return model
