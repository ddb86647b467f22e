"""Config loading: the seed's YAML as written, and clear errors for bad keys/values."""

import pytest

from slimkv.config import Config, ConfigError

SEED_YAML = """\
kv_cache:
  dtype: int8
  paged: true
  block_size: 16
  max_concurrency_soft: 48
  evict_policy: lru_block
"""


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_seed_yaml_loads_exactly_as_written(tmp_path):
    cfg = Config.load(write(tmp_path, SEED_YAML))
    kv = cfg.kv_cache
    assert (kv.dtype, kv.paged, kv.block_size, kv.max_concurrency_soft, kv.evict_policy) == (
        "int8", True, 16, 48, "lru_block")
    assert kv.watermark == 0.7


def test_embedded_default_loads():
    cfg = Config.load()
    assert cfg.kv_cache.dtype == "int8" and cfg.model.path is None


def test_typo_key_is_rejected_with_its_name_and_a_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_cache\.dtyp: unknown key \(did you mean kv_cache\.dtype\?\)"):
        Config.load(write(tmp_path, "kv_cache:\n  dtyp: int8\n"))
    with pytest.raises(ConfigError, match="kv_cach: unknown key"):
        Config.load(write(tmp_path, "kv_cach:\n  dtype: int8\n"))


@pytest.mark.parametrize("text, key", [
    ("kv_cache:\n  dtype: int3\n", "kv_cache.dtype"),
    ("kv_cache:\n  k_dtype: float64\n", "kv_cache.k_dtype"),
    ("kv_cache:\n  block_size: 24\n", "kv_cache.block_size"),
    ("kv_cache:\n  evict_policy: random\n", "kv_cache.evict_policy"),
    ("kv_cache:\n  watermark: 1.5\n", "kv_cache.watermark"),
    ("kv_cache:\n  watermark: '0.5'\n", "kv_cache.watermark"),  # was a TypeError
    ("scheduler:\n  slow_lane_token_share: half\n", "scheduler.slow_lane_token_share"),
    ("kv_cache:\n  max_concurrency_soft: 0\n", "kv_cache.max_concurrency_soft"),
    ("model:\n  dtype: int8\n", "model.dtype"),
    ("model:\n  activations: fp16\n", "model.activations"),
    ("scheduler:\n  policy: lottery\n", "scheduler.policy"),
    ("server:\n  port: 70000\n", "server.port"),
])
def test_bad_values_name_their_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Config.load(write(tmp_path, text))


def test_unknown_dtype_lists_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="choose one of auto, float32.*int4"):
        Config.load(write(tmp_path, "kv_cache:\n  dtype: int3\n"))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Config.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Config.load(write(tmp_path, "kv_cache: [\n"))


def test_replace_revalidates():
    cfg = Config().replace("kv_cache", dtype="fp8")
    assert cfg.kv_cache.dtype == "fp8"
    with pytest.raises(ConfigError):
        Config().replace("kv_cache", dtype="bogus")


def test_default_yaml_only_repeats_the_dataclass_defaults():
    """configs/default.yaml documents the defaults; config.py is their one source."""
    import yaml

    from slimkv.config import DEFAULT_CONFIG_PATH

    written = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    defaults = Config()
    differ = [f"{section}.{key}: {value!r} != {getattr(getattr(defaults, section), key)!r}"
              for section, values in written.items() for key, value in values.items()
              if getattr(getattr(defaults, section), key) != value]
    assert not differ, differ
    assert Config.load().to_dict() == defaults.to_dict()


def test_removed_v_scale_is_rejected_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_cache\.v_scale: removed: values are always scaled"):
        Config.load(write(tmp_path, "kv_cache:\n  v_scale: group32\n"))


def test_session_ttl_is_a_config_key(tmp_path):
    assert Config.load(write(tmp_path, "kv_cache:\n  session_ttl_s: 30\n")).kv_cache.session_ttl_s == 30
    with pytest.raises(ConfigError, match=r"kv_cache\.session_ttl_s"):
        Config.load(write(tmp_path, "kv_cache:\n  session_ttl_s: 0\n"))


def test_cdiv():
    from slimkv.stats import cdiv

    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
