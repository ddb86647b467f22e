"""Issue 46's statistics: the paired bootstrap against an independent computation, exact
McNemar p-values, sliding windows that cover the corpus once, and passkey needles at the
token positions their placement names. Needs only the embedded tokenizer."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from slimkv.eval.corpus import corpus_text, strided_windows
from slimkv.eval.harness import SUITES
from slimkv.eval.perplexity import TokenStats
from slimkv.eval.prompts import MAX_NEW_TOKENS
from slimkv.eval.retrieval import BLOCK, _key_span, placed_passkey_probes
from slimkv.eval.stats import McNemar, mcnemar, mcnemar_p, paired_bootstrap, resample_indices
from slimkv.model_io import Tokenizer, default_model_path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def _windows(rng: random.Random, n: int, shift: float = 0.0) -> list[TokenStats]:
    out = []
    for _ in range(n):
        tokens = rng.randint(90, 110)
        out.append(TokenStats(tokens, tokens * (3.2 + rng.random() + shift),
                              tokens * rng.random() * 1e-3, tokens - rng.randint(0, 5)))
    return out


def test_bootstrap_matches_a_hand_computed_case() -> None:
    ref = [TokenStats(1, 1.0, 0.0, 1), TokenStats(1, 3.0, 0.0, 1)]
    run = [TokenStats(1, 2.0, 0.5, 0), TokenStats(1, 3.0, 0.1, 1)]
    idx = np.array([[0, 0], [1, 1], [0, 1]])
    out = paired_bootstrap(ref, run, indices=idx)
    # Resamples: ppl change 100 (e^1 - 1), 0, 100 (e^0.5 - 1); KL 0.5, 0.1, 0.3; top-1 0, 100, 50.
    ppl = sorted([100 * math.expm1(1.0), 0.0, 100 * math.expm1(0.5)])
    assert out["ppl_change_pct"].value == pytest.approx(100 * math.expm1(0.5))
    assert out["ppl_change_pct"].low == pytest.approx(np.percentile(ppl, 2.5))
    assert out["kl"].value == pytest.approx(0.3) and out["kl"].high == pytest.approx(0.49)
    assert out["top1_agreement"].value == 50 and out["top1_agreement"].low == pytest.approx(2.5)


def test_bootstrap_against_a_plain_python_resampling() -> None:
    rng = random.Random(7)
    ref, run = _windows(rng, 200), _windows(rng, 200, shift=0.01)
    idx = resample_indices(200)
    assert idx.shape == (2000, 200)
    out = paired_bootstrap(ref, run, indices=idx)
    changes, kls = [], []
    for row in idx.tolist():
        tokens = sum(ref[i].tokens for i in row)
        nll_ref, nll_run = sum(ref[i].nll for i in row), sum(run[i].nll for i in row)
        changes.append(100 * (math.exp(nll_run / tokens) / math.exp(nll_ref / tokens) - 1))
        kls.append(sum(run[i].kl for i in row) / tokens)
    cuts = statistics.quantiles(changes, n=40, method="inclusive")
    assert out["ppl_change_pct"].low == pytest.approx(cuts[0], rel=1e-9)
    assert out["ppl_change_pct"].high == pytest.approx(cuts[-1], rel=1e-9)
    kl_cuts = statistics.quantiles(kls, n=40, method="inclusive")
    assert (out["kl"].low, out["kl"].high) == pytest.approx((kl_cuts[0], kl_cuts[-1]))
    total_ref, total_run = sum(w.nll for w in ref), sum(w.nll for w in run)
    tokens = sum(w.tokens for w in ref)
    assert out["ppl_change_pct"].value == pytest.approx(
        100 * (math.exp(total_run / tokens) / math.exp(total_ref / tokens) - 1))
    assert out["ppl_change_pct"].low < out["ppl_change_pct"].value < out["ppl_change_pct"].high
    # Same seed, same draw: the interval is reproducible.
    assert paired_bootstrap(ref, run) == paired_bootstrap(ref, run)


def test_identical_formats_give_a_zero_width_interval_at_zero() -> None:
    ref = _windows(random.Random(1), 50)
    same = [TokenStats(w.tokens, w.nll, 0.0, w.tokens) for w in ref]
    out = paired_bootstrap(ref, same)
    assert (out["ppl_change_pct"].value, out["ppl_change_pct"].low,
            out["ppl_change_pct"].high) == (0, 0, 0)
    assert (out["kl"].low, out["kl"].high) == (0, 0)
    assert (out["top1_agreement"].low, out["top1_agreement"].high) == (100, 100)


def test_above_floor_subtracts_the_floor_on_the_same_resamples() -> None:
    rng = random.Random(3)
    ref, floor, run = _windows(rng, 100), _windows(rng, 100), _windows(rng, 100)
    assert all(v.value == 0 and v.low == 0 and v.high == 0
               for v in paired_bootstrap(ref, floor, floor).values())
    plain, above = paired_bootstrap(ref, run), paired_bootstrap(ref, run, floor)
    base = paired_bootstrap(ref, floor)
    assert above["kl"].value == pytest.approx(plain["kl"].value - base["kl"].value)


@pytest.mark.parametrize(("b", "c", "p"), [
    (0, 0, 1.0), (5, 0, 0.0625), (0, 5, 0.0625), (1, 0, 1.0), (3, 3, 1.0),
    (10, 2, 158 / 4096),          # R: binom.test(2, 12)$p.value = 0.03857
    (6, 0, 0.03125), (8, 1, 0.0390625),
])
def test_exact_mcnemar_p_values(b: int, c: int, p: float) -> None:
    assert mcnemar_p(b, c) == pytest.approx(p, rel=1e-12)


def test_mcnemar_counts_discordant_pairs() -> None:
    ref = [True, True, True, False, False, True]
    run = [True, False, False, True, False, True]
    assert mcnemar(ref, run) == McNemar(b=2, c=1)
    assert mcnemar(ref, ref).to_dict() == {"b": 0, "c": 0, "p": 1.0}


def test_strided_windows_are_disjoint_and_cover_the_corpus(tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.encode(corpus_text(), add_special_tokens=False)
    windows = strided_windows(tokenizer, 1024, 200)
    assert len(windows) == 200
    scored = [n for _, n in windows]
    assert sum(scored) == len(ids) - 1 and max(scored) - min(scored) <= 1
    end = 1
    for window, n in windows:
        end += n                   # each scored segment starts where the last one ended
        assert len(window) == min(1024, end) and window == ids[end - len(window):end]
    assert end == len(ids)
    # Past the corpus head every scored token sees at least 1,024 - stride tokens before it.
    assert all(len(w) == 1024 for w, _ in windows[10:])


def test_needles_sit_at_their_token_positions(tokenizer: Tokenizer) -> None:
    placements = ["block0", "block1", "edge16", "edge_mid", 0.5, 1.0]
    probes = placed_passkey_probes(tokenizer, [1024, 2048], placements, keys=10)
    assert len(probes) == 2 * len(placements) * 10
    assert probes == placed_passkey_probes(tokenizer, [1024, 2048], placements, keys=10)
    assert len({p.answer for p in probes}) == len(probes)
    for probe in probes:
        start, end = probe.needle
        first, last = _key_span(tokenizer, probe.prompt_ids[start:end], probe.answer)
        digits = (start + first, start + last)          # [start, end) of the key's tokens
        assert len(probe.prompt_ids) + MAX_NEW_TOKENS <= probe.context
        assert len(probe.prompt_ids) >= 0.95 * probe.context
        assert probe.answer not in tokenizer.decode(probe.prompt_ids[end:])
        if probe.label == "block0":
            assert 2 <= start and end <= BLOCK
        elif probe.label == "block1":
            assert BLOCK <= start and end <= 2 * BLOCK and 18 <= start <= 20
        elif probe.label == "edge16":
            assert digits[0] <= 15 and digits[1] > 16        # key tokens on 15 and 16
        elif probe.label == "edge_mid":
            edge = BLOCK * round(digits[0] / BLOCK)
            assert edge >= probe.context // 4 and digits[0] < edge < digits[1]
        else:
            assert abs(probe.depth - float(probe.label.rstrip("%")) / 100) < 0.05


def test_stats_suite_settings(tokenizer: Tokenizer) -> None:
    suite = SUITES["stats"]
    assert suite.strided_windows >= 200 and suite.keys_per_cell >= 10 and suite.floor_chunk
    probes = suite.probes(tokenizer)
    labels = {p.label for p in probes}
    assert {"block0", "block1", "edge16", "edge_mid"} <= labels
    assert all(sum(p.label == label for p in probes) >= 10 for label in labels)
    assert len(suite.windows(tokenizer)) == suite.strided_windows
