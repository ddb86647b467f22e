"""Where int8 KV loses precision in bf16 activations (docs/accuracy.md, stats suite): the real
K and V of one 512-token corpus window (bf16 model), int8's error (per-channel-block keys,
per-token values) against the extra rounding of dequantizing into bf16, as the int8 prefill
path does, instead of float32. Usage:
  PYTHONPATH=$PWD .venv/bin/python scripts/int8_dequant_rounding.py
"""
import torch
from slimkv.config import Config
from slimkv.eval import corpus
from slimkv.eval.harness import eval_config
from slimkv.kv.block_scales import per_channel_block
from slimkv.kv.quant import make_codec
from slimkv.llm import LLM
llm = LLM(eval_config(Config.load().replace("model", device="cpu", dtype="bfloat16"), "bfloat16", 512))
att = llm.engine.runner.attention
cap = {}
orig = type(att).__call__
def hook(self, layer, q, k, v, meta):
    cap[layer] = (k.detach().clone(), v.detach().clone())
    return orig(self, layer, q, k, v, meta)
type(att).__call__ = hook
ids = corpus.windows(llm.tokenizer, 512, 1)[0]
llm.engine.score(ids)
type(att).__call__ = orig
kc = per_channel_block(make_codec("int8", 64))
vc = make_codec("int8", 64)
rows = []
for layer in sorted(cap):
    k, v = cap[layer]
    for side, x, codec in (("K", k, kc), ("V", v, vc)):
        xx = x.unflatten(0, (-1, 16)) if side == "K" else x
        q = codec.quantize(xx)
        d32 = codec.dequantize(q, torch.float32)
        d16 = codec.dequantize(q, torch.bfloat16).float()
        ref = xx.float()
        rms = lambda t: t.pow(2).mean().sqrt().item()
        rows.append((layer, side, rms(ref), rms(d32 - ref), rms(d16 - d32),
                     rms(ref.to(torch.bfloat16).float() - ref)))
for side in "KV":
    r = [x for x in rows if x[1] == side]
    qe = sum(x[3] ** 2 for x in r) / len(r); re = sum(x[4] ** 2 for x in r) / len(r)
    print(f"{side}: mean over layers: int8 error RMS {qe ** .5:.4g}, extra bf16 rounding of the "
          f"dequantized values RMS {re ** .5:.4g} -> variance share {re / qe:.1%} "
          f"(values RMS {(sum(x[2] ** 2 for x in r) / len(r)) ** .5:.3g})")
print("worst layers by bf16 share:", sorted(((x[4] / x[3]) ** 2, x[0], x[1]) for x in rows)[-3:])
