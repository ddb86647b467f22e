"""kv_cache.int4's rotations (issue 46): the Hadamard matrix, the C transform against it,
q.k unchanged, and the whole model's logits with the rotations over float KV equal to
without (rotating float KV changes rounding only: an independent check of the online
rotation and of the folding into dense weights); then, on the embedded model's own
activations, int4 with the rotations closer to float KV than without."""

from __future__ import annotations

import pytest
import torch

from slimkv.attention.backend import AttentionBackend, hadamard
from slimkv.backends.cpu_step import hadamard_kernel
from slimkv.config import Config, ConfigError
from slimkv.eval import corpus
from slimkv.kernels.qgemm import qgemm_native
from slimkv.kv.layers import side_codec
from slimkv.model_io.rotate import fold_v_rotation
from slimkv.plugins import build_engine

CPU = torch.device("cpu")


@pytest.mark.parametrize("dim", [2, 16, 64, 128])
def test_hadamard_is_orthonormal_and_symmetric(dim: int) -> None:
    h = hadamard(dim, CPU)
    torch.testing.assert_close(h @ h.T, torch.eye(dim), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T)
    assert torch.equal(h.abs(), torch.full((dim, dim), dim ** -0.5))


def test_a_head_dim_that_is_not_a_power_of_two_is_refused() -> None:
    with pytest.raises(ValueError, match=r"kv_cache.int4.*power-of-two head_dim, got 96"):
        hadamard(96, CPU)


@pytest.mark.parametrize("dim", [64, 128])
def test_the_c_transform_is_the_matrix_product(dim: int) -> None:
    """decode_step.c's butterflies against x @ H (float64 as the truth), and q.k unchanged."""
    rotate = hadamard_kernel()
    if rotate is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(dim)
    q, k = (torch.randn(7, h, dim, generator=gen) * 3 for h in (6, 2))
    exact = q.double() @ hadamard(dim, CPU).double()
    torch.testing.assert_close(rotate(q).double(), exact, rtol=0, atol=1e-5)
    torch.testing.assert_close(AttentionBackend.rotate(None, q).double(), exact, rtol=0,
                               atol=1e-5)
    scores = torch.einsum("thd,tgd->thg", q.double(), k.double())
    rotated = torch.einsum("thd,tgd->thg", rotate(q).double(), rotate(k).double())
    torch.testing.assert_close(rotated, scores, rtol=0, atol=1e-4)
    assert torch.equal(rotate(rotate(q)), rotate(rotate(q)))  # deterministic
    torch.testing.assert_close(rotate(rotate(q)), q, rtol=0, atol=1e-5)  # H is its own inverse


def test_config_section() -> None:
    kv = Config.from_dict({"kv_cache": {"int4": {"group_size": 64, "rotate_k": True}}}).kv_cache
    assert (kv.int4.group_size, kv.int4.rotate_k, kv.int4.rotate_v) == (64, True, False)
    assert Config().kv_cache.int4.group_size == 32 and not Config().kv_cache.int4.rotate_k
    for bad, key in [({"group_size": 48}, "group_size"), ({"rotate_v": "yes"}, "rotate_v"),
                     ({"rotate": True}, "rotate")]:
        with pytest.raises(ConfigError, match=rf"^kv_cache\.int4\.{key}: "):
            Config.from_dict({"kv_cache": {"int4": bad}})


# -- the whole model ---------------------------------------------------------------------


def _engine(kv_dtype: str, weights: str = "float32", **int4):
    config = Config.load().replace("model", weights=weights, dtype="float32")
    config = config.replace("kv_cache", dtype=kv_dtype, num_blocks=64, int4=int4,
                            enable_prefix_caching=False)
    return build_engine(config)


@pytest.fixture(scope="module")
def window() -> list[int]:
    engine = _engine("float32")
    return corpus.windows(engine.runner.tokenizer, 160, 1)[0]


def _logits(engine, window: list[int]) -> torch.Tensor:
    return engine.score(window).float()


def _rotate_every_layer(engine, k: bool, v_online: bool, fold_v: bool = False) -> None:
    """Rotations on float KV (the config applies them to int4 layers only)."""
    runner = engine.runner
    runner.attention.rotate = [(k, v_online)] * runner.model_args.num_layers
    if fold_v:
        runner.model = fold_v_rotation(runner.model, list(range(runner.model_args.num_layers)))


@pytest.mark.parametrize("weights", ["float32", "int4"])  # dense: V folded; quantized: online
def test_rotations_over_float32_kv_keep_the_logits(window: list[int], weights: str) -> None:
    dense = weights == "float32"
    if not dense and not qgemm_native():
        pytest.skip("quantized weights need the native weight kernel")
    base = _logits(_engine("float32", weights), window)
    engine = _engine("float32", weights)
    _rotate_every_layer(engine, k=True, v_online=not dense, fold_v=dense)
    rotated = _logits(engine, window)
    assert (rotated - base).abs().max() < 2e-3, (rotated - base).abs().max()
    assert torch.equal(rotated.argmax(-1), base.argmax(-1))


def test_rotations_over_bfloat16_kv_keep_the_logits(window: list[int]) -> None:
    """bfloat16 KV rounds rotated and unrotated vectors differently: the difference is of
    the size bfloat16 storage itself makes (against float32 KV), not more."""
    f32 = _logits(_engine("float32"), window)
    base = _logits(_engine("bfloat16"), window)
    engine = _engine("bfloat16")
    _rotate_every_layer(engine, k=True, v_online=True)
    rotated = _logits(engine, window)
    rounding = (base - f32).abs().max()
    assert (rotated - base).abs().max() <= 3 * rounding, ((rotated - base).abs().max(), rounding)


def test_v_folded_into_dense_weights_is_a_copy() -> None:
    """The loader's models are cached: folding copies what it changes, shares the rest."""
    engine = _engine("int4", rotate_v=True)
    model = engine.runner.model
    assert model.v_rotated and engine.runner.attention.rotate[0] == (False, False)
    plain = _engine("int4").runner.model
    assert not hasattr(plain, "v_rotated")
    a, b = model.layers[0].attention, plain.layers[0].attention
    assert a.wqkv.weight is not b.wqkv.weight and a.wo.weight is not b.wo.weight
    assert model.tok_embeddings.weight is plain.tok_embeddings.weight
    q_dim = a.num_heads * a.head_dim
    assert torch.equal(a.wqkv.weight[:q_dim], b.wqkv.weight[:q_dim])  # Q and K untouched


# -- int4 on the model's own activations -----------------------------------------------


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    p = reference.log_softmax(-1)
    return float((p.exp() * (p - logits.log_softmax(-1))).sum(-1).mean())


@pytest.fixture(scope="module")
def captured(window: list[int]):
    """Every layer's K (after RoPE) and V of the window, from a float32-KV engine."""
    engine = _engine("float32")
    attention, keys, values = engine.runner.attention, [], []
    forward = attention.backend.forward

    def record(layer, q, k, v, meta):
        keys.append(k.float().clone())
        values.append(v.float().clone())
        return forward(layer, q, k, v, meta)

    attention.backend.forward = record
    engine.score(window)
    return torch.stack(keys), torch.stack(values)  # [layers, T, H, D]


def _error(x: torch.Tensor, codec, rotate: bool) -> float:
    """Relative error of int4 ``x [layers, T, H, D]`` in the original basis (whole blocks
    of 16 tokens: per-channel-block codecs reduce over them)."""
    h = hadamard(x.shape[-1], CPU)
    tokens = x.shape[1] // 16 * 16
    x = x[:, :tokens].unflatten(1, (-1, 16))
    y = x @ h if rotate else x
    back = codec.dequantize(codec.quantize(y), torch.float32)
    back = back @ h.T if rotate else back
    return float((back - x).norm() / x.norm())


@pytest.mark.parametrize("k_scale, group_size", [("per_token", 32), ("per_token", 64)])
def test_rotated_int4_keys_and_values_reconstruct_better(captured, k_scale: str,
                                                         group_size: int) -> None:
    keys, values = captured
    codec = side_codec("int4", keys.shape[-1], k_scale, group_size)
    assert _error(keys, codec, rotate=True) < _error(keys, codec, rotate=False)
    assert _error(values, codec, rotate=True) < _error(values, codec, rotate=False)


def test_rotated_int4_is_closer_to_float_kv(window: list[int]) -> None:
    """KL to float32 KV of per-token int4 keys (groups of 64), with and without rotate_k."""
    reference = _logits(_engine("float32"), window)
    kv = {"k_scale": "per_token"}

    def kl(**int4) -> float:
        engine = build_engine(Config.load().replace("model", weights="float32", dtype="float32")
                              .replace("kv_cache", dtype="int4", num_blocks=64, **kv,
                                       int4={"group_size": 64, **int4}))
        return _kl(_logits(engine, window), reference)

    assert kl(rotate_k=True) < kl()
    assert kl(rotate_k=True, rotate_v=True) < kl()


def test_eval_dtype_strings_take_the_int4_options() -> None:
    from slimkv.eval.harness import eval_config

    kv = eval_config(Config(), "int4:per_token+g64+rotate_k+rotate_v", 1024).kv_cache
    assert (kv.dtype, kv.k_scale) == ("int4", "per_token")
    assert (kv.int4.group_size, kv.int4.rotate_k, kv.int4.rotate_v) == (64, True, True)
    assert eval_config(Config(), "int4", 1024).kv_cache.int4 == Config().kv_cache.int4
    edges = eval_config(Config(), "int4+rotate_k+int8_layers=0.1.28.29", 1024).kv_cache
    assert (edges.dtype, edges.layer_dtypes, edges.int4.rotate_k) == \
        ("int4", {"int8": [0, 1, 28, 29]}, True)
    assert eval_config(Config(), "int4", 1024).kv_cache.layer_dtypes is None
    with pytest.raises(ConfigError, match=r"kv_cache\.int4\.rotate_q: unknown key"):
        eval_config(Config(), "int4+rotate_q", 1024)


def test_bits_per_element_counts_the_real_layout() -> None:
    from slimkv.planner import bits_per_element

    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, k_dtype="int4", v_dtype="int4",
                 block_size=16)
    assert bits_per_element(1024, **shape, k_scale="per_token") == 5.0
    assert bits_per_element(1024, **shape, k_scale="per_token", int4_group_size=64) == 4.5
    assert bits_per_element(1024, **shape, k_scale="per_channel_block") == 5.5  # K 6, V 5
    # a partial last block counts whole
    assert bits_per_element(1000, **shape, k_scale="per_token") == 5.0 * 1008 / 1000
    assert bits_per_element(64, **{**shape, "k_dtype": "bfloat16", "v_dtype": "bfloat16"},
                            k_scale="per_token") == 16.0
