"""slimkv.model against transformers: the embedded GGUF, tiny random HF dirs, tokenizer, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from slimkv.model import ModelArgs, Transformer
from slimkv.model_io import Tokenizer, default_model_path, load_model

CPU = torch.device("cpu")
PROMPTS = [
    "The capital of France is", "def fibonacci(n):",
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name 3 colors."}],
]


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Decode-sized ops are dominated by OpenMP hand-offs: 1 thread is ~10x faster on a busy box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
         causal: bool = False) -> Tensor:
    """[T, heads, head_dim] attention; GQA by repeating the kv heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).transpose(0, 1)


class ContiguousAttention:
    """Reference attention for one sequence, with a growing per-layer KV cache."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer in self.kv:
            k, v = torch.cat([self.kv[layer][0], k]), torch.cat([self.kv[layer][1], v])
        self.kv[layer] = (k, v)
        T, S = q.shape[0], k.shape[0]
        # New queries sit at the end of the context; a lone decode query sees everything.
        mask = None if T in (1, S) else torch.ones(T, S, dtype=torch.bool).tril(S - T)
        return sdpa(q, k, v, mask, causal=T == S > 1)


@torch.inference_mode()
def logits(model: Transformer, ids: list[int]) -> Tensor:
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention())
    return model.compute_logits(hidden)


@torch.inference_mode()
def greedy(model: Transformer, ids: list[int], n: int) -> list[int]:
    attn, x, pos, out = ContiguousAttention(), torch.tensor(ids), torch.arange(len(ids)), []
    for _ in range(n):
        out.append(int(model.compute_logits(model(x, pos, attn)[-1:])[0].argmax()))
        x, pos = torch.tensor(out[-1:]), pos[-1:] + 1
    return out


@torch.inference_mode()
def hf_greedy(ref: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    res, out = ref(torch.tensor([ids]), use_cache=True), []
    for _ in range(n):
        out.append(int(res.logits[0, -1].argmax()))
        res = ref(torch.tensor([out[-1:]]), cache=res.cache, use_cache=True)
    return out


# ---------------------------------------------------------------- embedded GGUF (slow)

@pytest.fixture(scope="module")
def smol() -> tuple[ModelArgs, Transformer, Tokenizer]:
    return load_model(None, torch.float32, CPU)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_embedded_matches_transformers(smol, hf_reference, prompt) -> None:
    _, model, tok = smol
    ids = tok.encode(prompt) if isinstance(prompt, str) else tok.apply_chat_template(prompt)
    generated = greedy(model, ids, 32)
    assert generated == hf_greedy(hf_reference, ids, 32)
    full = ids + generated
    with torch.inference_mode():
        expected = hf_reference(torch.tensor([full])).logits[0]
    diff = (logits(model, full) - expected).abs().max().item()
    print(f"max |logit diff| over {len(full)} tokens: {diff:.2e}")
    assert diff < 1e-3


@pytest.mark.slow
def test_embedded_args_and_tokenizer(smol: tuple[ModelArgs, Transformer, Tokenizer]) -> None:
    args, model, tok = smol
    eps = args.rms_norm_eps  # float32 1e-5 in the GGUF
    assert args == ModelArgs("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, eps, 8192, True, False)
    assert eps == pytest.approx(1e-5) and load_model(None, torch.float32, CPU)[1] is model
    assert tok.name == "SmolLM2-135M-Instruct" and tok.vocab_size == 49152
    assert {0, 2} <= tok.eos_token_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert chat == tok.hf.encode(text, add_special_tokens=False)
    assert chat[0] == 1 and chat.count(2) == 2 and tok.decode(chat[-3:]) == "assistant\n"
    for s in ["Hello, world!", "  leading spaces\nand\ttabs", "Ünïcödé 日本語 🙂", ""]:
        assert tok.decode(tok.encode(s)) == s


@pytest.mark.slow
def test_bfloat16_close_to_float32(smol: tuple[ModelArgs, Transformer, Tokenizer]) -> None:
    _, model32, tok = smol
    _, model16, _ = load_model(None, torch.bfloat16, CPU)
    assert model16.tok_embeddings.weight.dtype == torch.bfloat16
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    out16, out32 = logits(model16, ids), logits(model32, ids)
    agree = (out16.argmax(-1) == out32.argmax(-1)).float().mean().item()
    assert out16.dtype == torch.float32 and agree >= 0.8, agree


# ---------------------------------------------------------------- tiny random HF dirs

def make_tiny(path: Path, arch: str) -> torch.nn.Module:
    """Write a random 2-layer model + tokenizer to ``path``; return the transformers model."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM)

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "qwen2":  # q/k/v biases, untied head
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
    else:  # head_dim != hidden / heads, tied head, non-default theta
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=32, rope_theta=500000.0,
                                             tie_word_embeddings=True))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.1)  # random norms and biases too
    model.save_pretrained(path, safe_serialization=True)
    bpe = ByteLevelBPETokenizer()  # a real byte-level BPE: transformers rebuilds it for qwen2
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"], vocab_size=300,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                            eos_token="<|endoftext|>").save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_hf_dir_matches_transformers(tmp_path: Path, arch: str) -> None:
    ref = make_tiny(tmp_path, arch)
    args, model, tok = load_model(str(tmp_path), torch.float32, CPU)
    assert args.arch == arch and args.attention_bias == (arch == "qwen2")
    ids = torch.randint(0, args.vocab_size, (40,)).tolist()
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (logits(model, ids) - expected).abs().max().item() < 1e-4
    assert greedy(model, ids, 8) == hf_greedy(ref, ids, 8)
    attn = ContiguousAttention()  # chunked prefill: 25 tokens, then 15 more on top
    with torch.inference_mode():
        model(torch.tensor(ids[:25]), torch.arange(25), attn)
        chunk = model.compute_logits(model(torch.tensor(ids[25:]), torch.arange(25, 40), attn))
    assert (chunk - expected[25:]).abs().max().item() < 1e-4
    assert tok.decode(tok.encode("the lazy fox")) == "the lazy fox"
    declared = {2} if arch == "llama" else set()  # LlamaConfig's default eos_token_id
    assert tok.eos_token_ids == {tok.hf.eos_token_id} | declared and tok.name == tmp_path.name
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_flat_batch_of_sequences(tmp_path: Path) -> None:
    """Tokens of several sequences in one forward equal separate forwards (positions restart)."""
    make_tiny(tmp_path, "llama")
    _, model, _ = load_model(str(tmp_path), torch.float32, CPU)
    seqs = [[5, 9, 11, 200], [7, 3], [42, 43, 44]]
    seq_of = torch.tensor([i for i, s in enumerate(seqs) for _ in s])
    mask = (seq_of[:, None] == seq_of[None, :]).tril()  # block-diagonal causal
    varlen = lambda layer, q, k, v: sdpa(q, k, v, mask)  # noqa: E731
    flat = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        batched = model.compute_logits(model(flat, positions, varlen))
    assert torch.allclose(batched, torch.cat([logits(model, s) for s in seqs]), atol=1e-5)


# ---------------------------------------------------------------- bad inputs

def test_missing_path_and_unsupported_arch(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"), torch.float32, CPU)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2") as err:
        load_model(str(tmp_path), torch.float32, CPU)
    assert str(tmp_path) in str(err.value)


def test_missing_tensor(tmp_path: Path) -> None:
    make_tiny(tmp_path, "qwen2")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias") as err:
        load_model(str(tmp_path), torch.float32, CPU)
    assert str(tmp_path) in str(err.value)


def test_model_args_validation() -> None:
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32)
    assert ModelArgs.from_hf_config(base).head_dim == 4
    with pytest.raises(ValueError, match="llama3"):
        ModelArgs.from_hf_config(base | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelArgs.from_hf_config(base | {"num_key_value_heads": 3})
    with pytest.raises(ValueError, match="mistral"):
        ModelArgs.from_hf_config(base | {"model_type": "mistral"})


def test_random_init_forward() -> None:
    args = ModelArgs(arch="qwen2", vocab_size=50, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4,
                     rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
                     attention_bias=True)
    model = Transformer(args, torch.float32, CPU)
    out = logits(model, [1, 2, 3, 4])
    assert out.shape == (4, 50) and out.dtype == torch.float32 and out.isfinite().all()
    assert not any(p.requires_grad for p in model.parameters())
