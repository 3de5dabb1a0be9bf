"""Validation before anything enters the engine (issue 12): SamplingParams' own ranges, what the engine
checks against the model (vocabulary, top_k), invalid Unicode, and all-or-nothing adds."""

from __future__ import annotations

import math

import pytest

from pagedserve import SamplingParams
from pagedserve.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
    check_text,
)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", 100.5), ("temperature", -0.1),
    ("top_p", math.nan), ("top_p", math.inf), ("min_p", math.nan), ("min_p", 1.5),
    ("presence_penalty", math.inf), ("frequency_penalty", math.nan),
    ("repetition_penalty", 1e-320), ("repetition_penalty", math.inf), ("repetition_penalty", 0.0),
    ("top_k", -2), ("top_k", 1.5), ("n", 0), ("n", 129), ("n", True),
    ("seed", SEED_MAX + 1), ("seed", SEED_MIN - 1), ("seed", 1.0),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", ["y" * (MAX_STOP_STRING_CHARS + 1)]), ("stop", ["\ud800"]),
    ("stop_token_ids", [-1]), ("stop_token_ids", list(range(2000))),
])
def test_sampling_params_rejects_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_sampling_params_edges_that_are_fine():
    SamplingParams(temperature=100.0, repetition_penalty=0.01, top_k=-1, seed=SEED_MIN)
    SamplingParams(seed=SEED_MAX, n=1)
    SamplingParams(seed=SEED_MAX - 3, n=4)  # samples use seed .. seed + 3
    with pytest.raises(ValueError, match="^seed:.*n=4"):
        SamplingParams(seed=SEED_MAX - 2, n=4)
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)


def test_check_text():
    assert check_text("prompt", "héllo 🙂") == "héllo 🙂"
    with pytest.raises(ValueError, match="^prompt: not valid Unicode"):
        check_text("prompt", "a\udfffb")


@pytest.mark.slow
def test_engine_checks_against_the_model_and_adds_all_or_nothing(llm_fp32):
    engine = llm_fp32.engine
    vocab = engine.model_config.vocab_size
    cases = [
        ("stop_token_ids", "hi", SamplingParams(stop_token_ids=[10**9], min_tokens=1)),
        ("stop_token_ids", "hi", SamplingParams(stop_token_ids=[max(vocab, engine.tokenizer.vocab_size)])),
        ("top_k", "hi", SamplingParams(top_k=vocab + 1, temperature=0.8)),
        ("top_k", "hi", SamplingParams(top_k=2**63, temperature=0.8)),
        ("prompt", "hi \ud800", SamplingParams()),
        ("prompt", {"prompt": "\ud800", "prompt_token_ids": [1, 2]}, SamplingParams()),
        ("prompt_token_ids", [vocab], SamplingParams(n=3)),
        ("max_tokens", "hi", SamplingParams(n=8, max_tokens=engine.max_model_len)),
        ("request_id", "hi", SamplingParams()),
    ]
    before = engine.stats()
    for field, prompt, params in cases:
        rid = "" if field == "request_id" else f"bad-{field}"
        with pytest.raises(ValueError, match=f"^{field}:"):
            engine.add_request(rid, prompt, params)
    after = engine.stats()
    assert (after.num_waiting, after.num_running, after.num_unfinished_requests) == (0, 0, 0)
    assert after.num_prompt_tokens == before.num_prompt_tokens and len(engine.generators) == 0
    # the edges are accepted: top_k = vocab, a stop id the model can produce
    engine.add_request("ok-edge", "hi", SamplingParams(top_k=vocab, temperature=0.8, seed=1, max_tokens=2,
                                                       stop_token_ids=[vocab - 1]))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_request_id_that_meets_a_running_samples_id_is_refused(llm_fp32):
    """An n > 1 request's samples run as "id#0", "id#1", ...: a request named like one of them (either order) is
    refused by name, and the engine goes on serving both the running request and new ones."""
    engine = llm_fp32.engine
    engine.add_request("x", "The capital of France is", SamplingParams(temperature=0, n=2, max_tokens=3))
    with pytest.raises(ValueError, match="^request_id:.*'x#0'"):
        engine.add_request("x#0", "Once upon a time", SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("y#1", "Once upon a time", SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match="^request_id:.*'y#1'"):
        engine.add_request("y", "hi", SamplingParams(temperature=0, n=2, max_tokens=3))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["x", "y#1"] and len(finished["x"].outputs) == 2
    engine.add_request("x#0", "hi", SamplingParams(temperature=0, max_tokens=2))  # free again once x finished
    while engine.has_unfinished_requests():
        engine.step()
