"""End-to-end engine tests on the bundled SmolLM2-135M (float32): batching, preemption, chunked prefill
and prefix caching never change greedy outputs; seeds, n, stops, lengths, abort, metrics, chat, traces.

The one-at-a-time greedy outputs of PROMPTS (computed once per module) are the reference the other
configurations are checked against; greedy decoding with fewer max_tokens gives a prefix of them.
"""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PREFIX = (
    "The following is a chapter from a long adventure novel about a young sailor named Mara and her crew, "
    "who travel across the stormy northern sea in search of a lost island. "
)
STARTS = [
    "On the first morning of the voyage,",
    "The captain looked at the old map and",
    "When the storm finally reached the ship,",
    "Mara climbed to the top of the mast because",
    "In the galley, the cook was preparing",
    "That night the stars were so bright that",
    "The old navigator told the crew a story about",
    "A strange bird landed on the deck and",
    "After three weeks at sea, the water supply",
    "The first mate, a tall man named Oskar,",
    "Far away on the horizon, Mara could see",
    "The youngest sailor on board had never",
    "Inside the captain's cabin there was a locked chest that",
    "When they finally reached the island, the beach was",
    "The letter that Mara found in the bottle said",
    "Before dawn, the whole crew gathered to",
]
PROMPTS = [PREFIX + q for q in STARTS]
REF_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=REF_TOKENS)


def engine_llm(**kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(dtype="float32", seed=0, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def new_records(llm: LLM, since: int):
    return list(llm.engine.step_records)[since:]


@pytest.fixture(scope="module")
def llm(llm_fp32) -> LLM:
    return llm_fp32


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """Each prompt generated on its own."""
    return [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]


def check_records(records, budget: int) -> None:
    for rec in records:
        assert rec.num_scheduled_tokens == sum(rec.scheduled.values())
        assert rec.num_scheduled_tokens <= budget == rec.token_budget
        assert rec.num_prefill_tokens + rec.num_decode_tokens == rec.num_scheduled_tokens


def tokens_per_request(records) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens computed per request since its last admission, and tokens recomputed after preemptions."""
    current: dict[str, int] = {}
    recomputed: dict[str, int] = {}
    for rec in records:
        for rid in rec.preempted:
            recomputed[rid] = recomputed.get(rid, 0) + current.pop(rid, 0)
        for rid, n in rec.scheduled.items():
            current[rid] = current.get(rid, 0) + n
    return current, recomputed


# ---- batching, preemption, chunked prefill and prefix caching do not change outputs ----------------


def test_batch_equals_one_at_a_time(llm, reference):
    since = len(llm.engine.step_records)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert all(o.outputs[0].text == llm.get_tokenizer().decode(r, skip_special_tokens=True)
               for o, r in zip(outs, reference, strict=True))
    records = new_records(llm, since)
    check_records(records, llm.engine.config.max_num_batched_tokens)
    assert max(len(r.scheduled) for r in records) == len(PROMPTS)  # really batched
    # Tokens per step add up to prompt + generated - 1 (the last token is never fed back) - cache hits.
    computed, recomputed = tokens_per_request(records)
    assert not recomputed
    for o in outs:
        assert computed[o.request_id] + o.num_cached_tokens == len(o.prompt_token_ids) + len(
            o.outputs[0].token_ids
        ) - 1
    assert sum(o.num_cached_tokens for o in outs) > 0  # the shared prefix was reused


def test_small_cache_preempts_and_matches(reference):
    # Prompts of 42-47 tokens take 3 blocks of 16 to prefill and a 4th from their 49th token on:
    # 7 blocks admit two of them and then force one out.
    small = engine_llm(num_kv_blocks=7, enable_prefix_caching=False)
    engine = small.engine
    n, max_tokens = 3, 12
    since = len(engine.step_records)
    outs = small.generate(PROMPTS[:n], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    assert token_ids(outs) == [r[:max_tokens] for r in reference[:n]]
    records = new_records(small, since)
    assert engine.num_preemptions > 0
    assert any(r.preempted for r in records)
    check_records(records, engine.config.max_num_batched_tokens)
    computed, recomputed = tokens_per_request(records)
    assert sum(recomputed.values()) > 0
    for o in outs:
        assert computed[o.request_id] == len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1
    total = sum(r.num_scheduled_tokens for r in records)
    assert total == sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs) + sum(
        recomputed.values()
    )
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_chunked_prefill_matches(reference):
    chunked = engine_llm(max_num_batched_tokens=16)
    engine = chunked.engine
    n, max_tokens = 2, 8
    since = len(engine.step_records)
    outs = chunked.generate(PROMPTS[:n], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    assert token_ids(outs) == [r[:max_tokens] for r in reference[:n]]
    records = new_records(chunked, since)
    check_records(records, 16)
    first = outs[0]
    prefill_steps = [r for r in records if first.request_id in r.prefill_requests]
    assert len(prefill_steps) >= len(first.prompt_token_ids) // 16  # the prompt was split over steps
    assert all(r.scheduled[first.request_id] <= 16 for r in prefill_steps)
    computed, _ = tokens_per_request(records)
    for o in outs:
        assert computed[o.request_id] + o.num_cached_tokens == len(o.prompt_token_ids) + len(
            o.outputs[0].token_ids
        ) - 1


def test_prefix_caching_on_and_off_match(reference):
    """Fresh engines, one batch: with caching on, later prompts share the prefix blocks the first one
    computes in the very same step; the outputs must not change either way."""
    n, max_tokens = 4, 12
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    expected = [r[:max_tokens] for r in reference[:n]]
    nocache = engine_llm(enable_prefix_caching=False)
    outs = nocache.generate(PROMPTS[:n], params, use_tqdm=False)
    assert token_ids(outs) == expected
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert all(r.prefix_cache_hits == 0 for r in nocache.engine.step_records)
    del nocache
    cached = engine_llm(enable_prefix_caching=True)
    outs = cached.generate(PROMPTS[:n], params, use_tqdm=False)
    assert token_ids(outs) == expected
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 32 for o in outs[1:])  # PREFIX spans two full blocks of 16
    assert cached.engine.step_records[0].prefix_cache_hits >= 32 * (n - 1)


# ---- sampling --------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=8)
    alone = llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8), SamplingParams(temperature=0, max_tokens=4)]
    batch = llm.generate(
        [PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[1]],
        [others[0], seeded, others[1], seeded.clone(seed=4321)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    assert batch[3].outputs[0].token_ids != alone  # another seed, another sample


def test_n_2_gives_two_samples_sharing_the_prompt_blocks(llm):
    engine = llm.engine
    prompt = PREFIX + "Name three animals that live in the desert and explain how they survive there."
    engine.add_request("n2", prompt, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6,
                                                                 ignore_eos=True))
    first = engine.step()
    samples = {r.request_id: r for r in engine.scheduler.requests.values() if r.parent_id == "n2"}
    assert set(samples) == {"n2#0", "n2#1"}
    num_prompt = samples["n2#0"].num_prompt_tokens
    full_blocks = (num_prompt - 1) // engine.config.block_size * engine.config.block_size
    assert samples["n2#1"].num_cached_tokens >= full_blocks > 0
    assert engine.step_records[-1].prefix_cache_hits >= full_blocks
    outputs = first
    while engine.has_unfinished_requests():
        outputs = engine.step() or outputs
    (out,) = [o for o in outputs if o.request_id == "n2"]
    assert out.finished
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    # Sample i draws with seed + i; sample 1 read sample 0's blocks, and must not notice.
    alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=8, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == out.outputs[1].token_ids
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in out.outputs)
    assert engine.kv_manager.pool.num_used_blocks == 0


# ---- stops and lengths -----------------------------------------------------------------------------


def test_max_tokens_gives_length(llm, reference):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == reference[0][:5]
    assert c.finish_reason == "length" and c.stop_reason is None


def test_stop_string_ends_generation(llm, reference):
    ids = reference[0]
    text = llm.get_tokenizer().decode(ids, skip_special_tokens=True)
    assert len(ids) == REF_TOKENS and len(text) > 40
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    idx = text.index(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, stop=["@@never@@", stop],
                                include_stop_str_in_output=include)
        c = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (text[: idx + len(stop)] if include else text[:idx])
        assert c.token_ids == ids[: len(c.token_ids)] and len(c.token_ids) < len(ids)
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_stop_string_on_the_last_allowed_token_is_a_stop(llm, reference):
    ids = reference[0]
    tok = llm.get_tokenizer()
    # Find k such that a 3-character stop string is completed exactly by token k (= max_tokens).
    for k in range(4, len(ids)):
        full = tok.decode(ids[:k])
        stop = full[-3:]
        if len(stop) == 3 and stop not in tok.decode(ids[: k - 1]):
            break
    else:
        pytest.skip("no suitable stop string in the reference output")
    c = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=k, stop=stop), use_tqdm=False)[0]
    c = c.outputs[0]
    assert c.token_ids == ids[:k]
    assert c.text == full[: full.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop


def test_stop_token_ids_end_generation(llm, reference):
    ids = reference[0]
    k = 4
    stop_tok = ids[k]
    first = ids.index(stop_tok)
    tok = llm.get_tokenizer()
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, stop_token_ids=[stop_tok],
                                include_stop_str_in_output=include)
        c = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == ids[: first + 1]
        assert c.finish_reason == "stop" and c.stop_reason == stop_tok
        # As vLLM: the stop token's text is left out unless include_stop_str_in_output.
        expected = tok.decode(ids[: first + 1] if include else ids[:first])
        assert c.text == expected


def test_eos_stops_and_min_tokens_holds_it_back(llm):
    engine = llm.engine
    eos = min(engine.eos_token_ids)
    # Find a prompt that ends immediately with EOS under greedy decoding.
    prompt = "Write a short poem about the sea and the wind that blows over it at night."
    c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] in engine.eos_token_ids and c.stop_reason is None
    assert eos not in c.token_ids[:-1]
    n_before = len(c.token_ids)
    c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=n_before + 3),
                     use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= n_before + 3
    assert not set(c.token_ids[: n_before + 3]) & engine.eos_token_ids
    c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length"


def test_min_tokens_holds_back_stop_strings_too(llm):
    """As vLLM's detokenizer: a stop string counts only once the output is longer than min_tokens, so the output
    goes on past a stop string its first min_tokens tokens made, and stops at the first one a later token ends."""
    tok = llm.engine.tokenizer
    prompt = "The capital of France is"
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    texts = [tok.decode(ref[:k]) for k in range(len(ref) + 1)]
    assert " " in texts[3]  # a stop string early in the output
    c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, min_tokens=10, stop=[" "],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    n = len(c.token_ids)
    assert n > 10 and c.finish_reason == "stop" and c.stop_reason == " "
    assert list(c.token_ids) == list(ref[:n])
    assert " " in texts[n][len(texts[n - 1]):] and all(" " not in texts[k][len(texts[k - 1]):] for k in range(11, n))
    assert c.text == texts[n][: texts[n].index(" ", len(texts[n - 1]))]


# ---- request lifecycle -----------------------------------------------------------------------------


def test_abort_mid_generation_frees_every_block(llm):
    engine = llm.engine
    pool = engine.kv_manager.pool
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"abort-{i}", PROMPTS[4 + i], params)
    for _ in range(3):
        engine.step()
    assert pool.num_used_blocks > 0
    (out,) = engine.abort_request("abort-1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 3
    assert engine.has_unfinished_requests()
    engine.step()
    outs = engine.abort_request(["abort-0", "abort-2", "no-such-request"])
    assert [o.request_id for o in outs] == ["abort-0", "abort-2"]
    assert pool.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert engine.step() == []


def test_too_long_requests_are_rejected_at_add_request(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", PROMPTS[0], SamplingParams(max_tokens=engine.max_model_len))
    assert not engine.has_unfinished_requests()
    short = engine_llm(max_model_len=48, num_kv_blocks=16)
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate([PROMPTS[0]], SamplingParams(max_tokens=10), use_tqdm=False)  # 40 + 10 > 48
    # A failing prompt in a batch leaves nothing behind.
    with pytest.raises(ValueError):
        short.generate(["Hi", PROMPTS[0]], SamplingParams(max_tokens=10), use_tqdm=False)
    assert not short.engine.has_unfinished_requests()
    assert short.engine.kv_manager.pool.num_used_blocks == 0
    # max_tokens=None fills up to max_model_len.
    prompt = PROMPTS[1]
    out = short.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 48
    assert out.outputs[0].finish_reason == "length"


def test_request_output_fields_and_metrics(llm):
    out = llm.generate([PROMPTS[5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt == PROMPTS[5]
    assert out.prompt_token_ids == llm.engine.tokenizer.encode(PROMPTS[5])
    assert out.finished
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time


def test_outputs_come_back_in_input_order(llm):
    prompts = [PROMPTS[7], PROMPTS[8], "Hello", PROMPTS[9]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 1, 5, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 5, 3]
    ids = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert ids[0].prompt is None and ids[0].prompt_token_ids == [1, 2, 3, 4]


def test_chat(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert len(out) == 1
    tok = llm.engine.tokenizer
    expected_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert out[0].prompt_token_ids == expected_ids
    assert out[0].outputs[0].token_ids and out[0].outputs[0].text.strip()
    two = llm.chat([messages, [{"role": "user", "content": "Say hello."}]],
                   SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(two) == 2
    assert two[0].outputs[0].token_ids == out[0].outputs[0].token_ids[:4]
