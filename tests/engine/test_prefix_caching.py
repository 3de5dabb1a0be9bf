"""Prefix caching: identical outputs on/off, the prefill it saves, eviction under pressure, collisions."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.core import kv_cache_manager

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SYSTEM = "You are a careful assistant who answers briefly and accurately about geography and history."


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, bundled_path):
    """A tiny random Llama with the bundled model's tokenizer: fast enough for thousands of tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.model.loader import load_hf_tokenizer

    torch.manual_seed(0)
    tok = load_hf_tokenizer(bundled_path)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _texts(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def test_outputs_identical_with_caching_on_and_off():
    prompts = [f"{SYSTEM} Question: what is the capital of {c}?" for c in ("France", "Peru", "Japan", "Kenya")]
    prompts += [prompts[0], prompts[1] + " Answer in one word."]
    on = LLM(dtype="float32", enable_prefix_caching=True)
    off = LLM(dtype="float32", enable_prefix_caching=False)
    # Twice on the caching engine: the second round is served from cached blocks.
    first = on.generate(prompts, GREEDY, use_tqdm=False)
    second = on.generate(prompts, GREEDY, use_tqdm=False)
    ref = off.generate(prompts, GREEDY, use_tqdm=False)
    assert _texts(first) == _texts(ref) == _texts(second)
    assert all(o.num_cached_tokens > 0 for o in second)
    assert off.engine.kv_manager.prefix_hits == 0

    # A multi-turn chat: each turn's prompt extends the previous one.
    history = [{"role": "system", "content": SYSTEM}]
    for question in ("Where is Lima?", "And what language is spoken there?", "Name one dish from there."):
        history.append({"role": "user", "content": question})
        a = on.chat(history, GREEDY, use_tqdm=False)[0]
        b = off.chat(history, GREEDY, use_tqdm=False)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        history.append({"role": "assistant", "content": a.outputs[0].text})
    assert a.num_cached_tokens >= 16  # the last turn reused the earlier turns' blocks


def test_shared_prefix_saves_over_90_percent_of_prefill(tiny_model_dir):
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 20000) for _ in range(1000)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(1000, 20000) for _ in range(24)]} for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    computed = {}
    outputs = {}
    for caching in (False, True):
        llm = LLM(tiny_model_dir, dtype="float32", enable_prefix_caching=caching, num_kv_blocks=4096)
        outputs[caching] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        computed[caching] = llm.engine.num_computed_prefill_tokens
        if caching:
            steps = llm.engine.step_records
            assert sum(r.prefix_cache_hits for r in steps) == llm.engine.kv_manager.prefix_hits > 0
    assert outputs[True] == outputs[False]
    assert computed[False] == 32 * 1024
    assert computed[True] <= 0.1 * computed[False], computed


def _check_no_conflicting_sharing(engine) -> None:
    """A block held by several requests must hold the same tokens for each of them."""
    kv, bs = engine.kv_manager, engine.kv_manager.block_size
    contents: dict[int, tuple] = {}
    for rid, blocks in kv.req_blocks.items():
        req = engine.scheduler.requests[rid]
        for i, block in enumerate(blocks):
            toks = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            if len(toks) < bs or i * bs + bs > req.num_computed_tokens:
                continue  # a partial block is never shared
            prev = contents.setdefault(block.block_id, toks)
            assert prev == toks, f"block {block.block_id} shared by requests with different tokens"


def _run_checked(llm: LLM, prompts, params):
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        _check_no_conflicting_sharing(engine)
        pool = engine.kv_manager.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert engine.kv_manager.pool.num_used_blocks == 0
    return [done[f"p{i}"] for i in range(len(prompts))]


def test_eviction_under_pressure_keeps_results_correct():
    base = f"{SYSTEM} Tell me about"
    prompts = [f"{base} {t}." for t in ("rivers", "mountains", "rivers", "deserts", "mountains", "rivers")]
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = LLM(dtype="float32", enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    # Barely more than one request's worth of blocks: requests evict each other's cached blocks.
    n_tokens = max(len(ref.engine.tokenizer.encode(p)) for p in prompts) + 16
    small = LLM(dtype="float32", enable_prefix_caching=True, num_kv_blocks=-(-n_tokens // 16) + 1)
    got = _run_checked(small, prompts, params)
    assert got == expected
    assert small.engine.kv_manager.pool.num_evicted > 0 or small.engine.kv_manager.prefix_hits > 0


def test_forced_hash_collision_never_reuses_wrong_blocks(monkeypatch):
    prompts = [f"{SYSTEM} Question {i}: name a city in {c}." for i, c in enumerate(("Chile", "Spain", "Chad"))]
    params = SamplingParams(temperature=0, max_tokens=10)
    ref = LLM(dtype="float32", enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, tokens: b"same-hash-for-everything")
    llm = LLM(dtype="float32", enable_prefix_caching=True)
    assert _run_checked(llm, prompts, params) == expected
    # All blocks collide, so one cached block answers every lookup; only its true owners' tokens hit.
    assert len(llm.engine.kv_manager.pool.cached) <= 1
