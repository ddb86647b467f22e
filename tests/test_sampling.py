"""Sampling parameters and the batched sampler."""

import pytest
import torch

from slimkv.sampling import Sampler, SamplingParams


def test_greedy_and_sampled_rows_in_one_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    assert Sampler()(logits, params, [None, None]) == [1, 0]


def test_seeded_sampling_is_reproducible_and_top_k_limits_choices():
    logits = torch.zeros(1, 100)
    p = SamplingParams(temperature=1.0, top_k=3, seed=7)
    logits[0, :3] = 1.0
    draws = [Sampler()(logits, [p], [torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    assert len(set(draws)) == 1 and draws[0] in (0, 1, 2)
    many = {Sampler()(logits, [p], [torch.Generator().manual_seed(s)])[0] for s in range(50)}
    assert many <= {0, 1, 2} and len(many) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    p = SamplingParams(temperature=1.0, top_p=0.5)
    draws = {Sampler()(logits, [p], [torch.Generator().manual_seed(s)])[0] for s in range(30)}
    assert draws == {0}


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"stop": [""]}, "stop"),
])
def test_bad_params_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
