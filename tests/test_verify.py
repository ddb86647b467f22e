"""Kernel-path verification: every KV dtype runs its fast path on the CPU; a forced fallback
fails verify and makes strict start-up refuse."""

from __future__ import annotations

import pytest

from slimkv.attention.layer import FAST_ENV
from slimkv.cli import main
from slimkv.config import Config, ConfigError
from slimkv.verify import ALL_KV_DTYPES, verify

pytestmark = pytest.mark.slow


@pytest.mark.usefixtures("fused_kernel")
def test_verify_passes_for_every_dtype_on_cpu() -> None:
    results = verify(Config(), list(ALL_KV_DTYPES))
    for r in results:
        assert r["ok"], r
        assert r["fallback_reason"] is None
        assert all(not layer["fallback"] and layer["match"] for layer in r["layers"])
        assert r["decode_kernel_unavailable"] is None  # decodes ran the fused kernel
        assert all(layer["paths"].get("fast_prefill") and layer["paths"].get("fused_decode")
                   for layer in r["layers"])
    pools = {r["kv_dtype"]: {t["tensor"]: t["dtype"] for t in r["pool"]} for r in results}
    assert pools["int8"] == {"k_data": "int8", "k_scale": "float16",
                             "v_data": "int8", "v_scale": "float16"}
    assert pools["fp8_e4m3"]["k_data"] == "uint8" and pools["int4"]["v_data"] == "uint8"


def test_forced_fallback_fails_verify_and_strict_startup(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    from slimkv.plugins import build_engine

    monkeypatch.setenv(FAST_ENV, "0")
    [result] = verify(Config(), ["int8"])
    assert not result["ok"]
    assert FAST_ENV in result["fallback_reason"]
    assert all(layer["fallback"] and layer["paths"] == {"reference": layer["paths"]["reference"]}
               for layer in result["layers"])
    with pytest.raises(ConfigError, match="cannot run its quantized attention path"):
        build_engine(Config.from_dict({"kv_cache": {"num_blocks": 16}}))
    assert main(["verify", "--kv-dtype", "int8"]) == 1
    assert "FAIL" in capsys.readouterr().out
