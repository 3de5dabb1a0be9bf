"""SamplingParams: vLLM field names, defaults and validation errors that name the field."""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"n": 1.0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": "abc"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_defaults_are_vllm_like():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert not p.greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"max_tokens": None, "min_tokens": 100},
        {"min_tokens": 5, "max_tokens": 5},
        {"seed": 0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    ],
)
def test_valid_edge_values(kwargs):
    SamplingParams(**kwargs)


def test_greedy_and_top_k_normalisation():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_string_or_list():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(stop=("x",)).stop_strings == ["x"]


def test_clone_revalidates_and_keeps_fields():
    p = SamplingParams(temperature=0.7, stop=["\n"], seed=3, max_tokens=9)
    q = p.clone(seed=4)
    assert (q.temperature, q.stop_strings, q.seed, q.max_tokens) == (0.7, ["\n"], 4, 9)
    assert p.seed == 3
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-1)
