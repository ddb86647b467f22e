"""``slimkv eval --sensitivity``: the greedy proposal meets the bit target, follows the
measured ranking, and the CLI prints a map that ``kv_cache.layer_dtypes`` accepts."""

from __future__ import annotations

import pytest
import yaml

from slimkv.cli import main
from slimkv.config import Config
from slimkv.eval.sensitivity import KVShape, Score, propose, rank

SMOLLM2 = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, k_scale="per_channel_block",
                  block_size=16)


def test_bits_per_value_include_scales() -> None:
    # int4: K 32 data + 2 * 64 * 2 / 16 scale/zero bytes, V 32 + 2 groups * 4 -> 88 / 128 B
    assert SMOLLM2.bits("int4") == 8 * 88 / 128
    assert SMOLLM2.bits("float32") == 32


def test_proposal_meets_target_with_the_most_sensitive_layers() -> None:
    ranking = [17, 3, 29, 0, 8, 12] + [i for i in range(30) if i not in (17, 3, 29, 0, 8, 12)]
    proposal = propose(ranking, SMOLLM2, "int4", "int8", 6.0)
    assert SMOLLM2.bits("int4", proposal) <= 6.0
    count = len(proposal["int8"])
    assert proposal["int8"] == sorted(ranking[:count])
    assert SMOLLM2.bits("int4", {"int8": sorted(ranking[:count + 1])}) > 6.0


def test_target_below_uniform_low_is_refused() -> None:
    with pytest.raises(ValueError, match="below int4 everywhere"):
        propose(list(range(30)), SMOLLM2, "int4", "int8", 5.0)


def test_rank_by_metric() -> None:
    scores = [Score(0.1, 0.003, 99.0), Score(0.5, 0.001, 98.0), Score(-0.1, 0.002, 99.5)]
    assert rank(scores, "perplexity") == [1, 0, 2]
    assert rank(scores, "kl") == [0, 2, 1]


@pytest.mark.slow
def test_cli_prints_an_accepted_map(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--sensitivity", "--window", "48", "--windows", "1",
                 "--target-bits", "6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    snippet = out.split("bits per KV value:\n", 1)[1].split("\n\n", 1)[0]
    config = Config.from_dict(yaml.safe_load(snippet))
    mix = config.kv_cache.layer_dtypes
    assert config.kv_cache.dtype == "int4" and SMOLLM2.bits("int4", mix) <= 6.0
    assert len(mix["int8"]) == 4
    table = out.split("top-1 %\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert sorted(int(row.split()[1]) for row in table[:4]) == mix["int8"]  # most sensitive
    assert "uniform int8" in out and "control: least sensitive" in out
