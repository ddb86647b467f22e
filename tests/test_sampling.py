"""Sampling parameters and the batched sampler."""

import pytest
import torch

from slimkv.options.logprobs import Logprobs
from slimkv.options.penalties import Penalties, process_logits_
from slimkv.engine.sampling import Sampler, SamplingParams, sample
from slimkv.engine.sequence import Sequence


def test_greedy_and_sampled_rows_in_one_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    assert sample(logits, params, [None, None]) == [1, 0]


def test_seeded_sampling_is_reproducible_and_top_k_limits_choices():
    logits = torch.zeros(1, 100)
    p = SamplingParams(temperature=1.0, top_k=3, seed=7)
    logits[0, :3] = 1.0
    draws = [sample(logits, [p], [torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    assert len(set(draws)) == 1 and draws[0] in (0, 1, 2)
    many = {sample(logits, [p], [torch.Generator().manual_seed(s)])[0] for s in range(50)}
    assert many <= {0, 1, 2} and len(many) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    p = SamplingParams(temperature=1.0, top_p=0.5)
    draws = {sample(logits, [p], [torch.Generator().manual_seed(s)])[0] for s in range(30)}
    assert draws == {0}


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"stop": [""]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"), ({"min_tokens": 17}, "min_tokens"), ({"n": 0}, "n"),
])
def test_bad_params_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


VOCAB = 6


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(max_tokens=16, **params))
    s.token_ids += output
    return s


def reference_row(logits: torch.Tensor, s: Sequence, eos: set[int]) -> torch.Tensor:
    """One row the slow, obvious way: a Python loop over the vocabulary."""
    p, out = s.params, s.output_token_ids
    row = logits.clone()
    for t in range(VOCAB):
        if s.num_output_tokens < p.min_tokens and (t in eos or t in p.stop_token_ids):
            row[t] = float("-inf")
            continue
        row[t] += p.logit_bias.get(t, 0.0)
        if t in s.token_ids and p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty * (t in out)
    return row


def test_batched_processors_match_a_per_token_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen) * 3
    seqs = [seq([1, 2], [3, 3, 4], presence_penalty=0.5, frequency_penalty=0.25),
            seq([1], [5], repetition_penalty=1.3),
            seq([0], [], logit_bias={2: 5.0, 4: -100.0}),
            seq([0], [1], min_tokens=3, stop_token_ids=[3]),
            seq([2, 2], [2, 1], temperature=0)]
    expected = torch.stack([reference_row(logits[i], s, {0}) for i, s in enumerate(seqs)])
    got = logits.clone()
    process_logits_(got, seqs, frozenset({0}))
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[4], logits[4])  # a row with no options is untouched


def test_logprobs_are_the_raw_log_softmax_with_the_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, 0.5], [0.0] * VOCAB])
    seqs = [seq([1], [], temperature=0, logprobs=2, presence_penalty=2.0),
            seq([1], [], temperature=0)]
    seqs[0].token_ids += [1]  # penalised in the draw, not in the reported logprobs
    out = Sampler([Logprobs(), Penalties(frozenset())])(logits, seqs)
    raw = logits[0].log_softmax(-1)
    assert out[0].token_id == 2
    assert out[0].logprob == pytest.approx(raw[2].item())
    assert [t for t, _ in out[0].top] == [1, 2]
    assert [lp for _, lp in out[0].top] == pytest.approx([raw[1].item(), raw[2].item()])
    assert out[1].logprob is None and out[1].top is None


def test_argmax_rows_matches_torch_argmax():
    """The greedy pick equals torch's argmax(dim=-1): first maximum on ties, NaN as the
    maximum, -inf rows, non-contiguous rows, and non-float32 logits (torch's own path)."""
    from slimkv.engine.sampling import argmax_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 10] = x[1, 900] = x[1].max() + 1  # tie: the first
    x[2, 33] = float("nan")
    x[2, 500] = float("nan")
    x[3] = float("-inf")
    x[4] = 0.0
    for logits in (x, x[:, ::3], x[::2], x.to(torch.bfloat16), x.double()):
        assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
