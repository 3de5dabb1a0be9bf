"""Speculative decoding: exactness for greedy, the target's distribution for sampling, and the bookkeeping
(lookahead slots rolled back, stops, max_tokens, preemption, prefix cache, mixed batches)."""

from __future__ import annotations

import random

import pytest
import torch
from sched_helpers import run_checking_blocks

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kernels import CpuKernels
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.rejection_sampler import verify
from pagedserve.sampling.sampler import Sampler
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": None}
SELF_DRAFT = {"method": "draft_model", "draft_num_layers": 12, "num_speculative_tokens": 2,
              "disable_by_batch_size": None}

PARAGRAPHS = [
    "The committee met on Tuesday to review the budget, and after a long discussion it approved the new "
    "library, the park renovation and the road repairs.",
    "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\nprint(area(5, 6))",
    "Alice walked to the market, bought three apples and a loaf of bread, and walked home along the river.",
    "Water boils at 100 degrees Celsius at sea level; at higher altitudes it boils at lower temperatures.",
]
INSTRUCTIONS = ["Repeat the text exactly:", "Rewrite it with one word changed:", "Copy it:", "Quote it:"]
OTHER = ["The capital of France is", "List the days of the week:", "Once upon a time", "1, 2, 3, 4, 5,",
         "Write a haiku about the sea.", "The three primary colors are", "def fibonacci(n):", "Hello, my name is"]


def prompts_32() -> list[str]:
    copy = [f"{t}\n\n{para}\n\n{ins}\n" for para in PARAGRAPHS for ins in INSTRUCTIONS for t in ("Text:",)]
    copy += [f"{para}\n{para}\n" for para in PARAGRAPHS]
    return (copy + OTHER + OTHER)[:32]


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(dtype="float32", speculative_config=NGRAM)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("value, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "backoff": "yes"}, "backoff"),
    ("{not json", "speculative_config"),
    ([1, 2], "speculative_config"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value)


def test_speculative_config_defaults_as_vllm():
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.from_value({"model": "m", "num_speculative_tokens": 2}).method == "draft_model"


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(dtype="float32", speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})


# ---- the n-gram proposer -------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_suffix():
    p = NgramProposer(1, 3)
    seq = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert p.lookup("a", seq, 3) == [8, 9, 1]  # "6 7" occurred at 1..2, followed by 8 9 1
    seq += [8]
    assert p.lookup("a", seq, 2) == [9, 1]  # "6 7 8" (incremental index)
    assert p.lookup("b", [1, 2, 3], 2) == []  # no earlier occurrence
    # A short loop: the latest occurrence has too few tokens after it, so the first one is used.
    assert p.lookup("c", [4, 1, 1, 1, 1, 1, 1], 3) == [1, 1, 1]


# ---- the rejection sampler on known distributions -----------------------------------------------
def _chi2_pvalue(observed: list[int], expected: list[float]) -> float:
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    df = sum(1 for e in expected if e > 0) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _meta(rows: int, temperature: float, top_k: int, gen: torch.Generator) -> SamplingMetadata:
    return SamplingMetadata(num_rows=rows, all_greedy=False, all_plain_greedy=False,
                            greedy=torch.zeros(rows, dtype=torch.bool),
                            temperature=torch.full((rows, 1), temperature),
                            top_k=torch.full((rows,), top_k) if top_k else None,
                            top_p=torch.ones(rows) if top_k else None, min_p=None, generators=[gen] * rows,
                            num_logprobs=[None] * rows)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpp"])
@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k, kernels):
    """Each emitted position has the target's distribution (temperature and top-k applied), whatever the
    drafts: chi-square goodness of fit over 6000 seeded verifications, position by position; the target's
    distributions from torch ops, or from the C++ kernel's weights that plain sampling draws from."""
    torch.manual_seed(0)
    vocab, drafts = 7, [2, 5, 0]
    logits = torch.randn(len(drafts) + 1, vocab) * 1.5
    sampler = Sampler(seed=1, kernels=CpuKernels.build() if kernels else None)
    if kernels:  # the same distributions as the torch path's
        meta = _meta(len(drafts) + 1, temperature, top_k, torch.Generator())
        torch.testing.assert_close(sampler.probs(logits, meta), Sampler().probs(logits, meta))
    gen = torch.Generator().manual_seed(123)
    meta = _meta(len(drafts) + 1, temperature, top_k, gen)
    target = sampler.probs(logits, meta)  # the distributions the emitted tokens must follow
    first = [0] * vocab
    second_given_accept = [0] * vocab
    n = 6000
    for _ in range(n):
        out = verify(sampler, logits.clone(), meta, [drafts]).token_ids[0]
        assert 1 <= len(out) <= len(drafts) + 1
        assert out[:-1] == drafts[: len(out) - 1]  # only a prefix of the drafts is ever kept
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second_given_accept[out[1]] += 1
    assert _chi2_pvalue(first, [n * float(p) for p in target[0]]) > 1e-3
    m = sum(second_given_accept)
    assert m > 300
    assert _chi2_pvalue(second_given_accept, [m * float(p) for p in target[1]]) > 1e-3


def test_rejection_sampling_without_drafts_draws_as_plain_sampling():
    """A seeded row with no drafts consumes its generator as the plain sampler does: the same token."""
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    sampler = Sampler(seed=0)
    for seed in range(20):
        meta = _meta(3, 0.9, 0, None)
        meta.generators = [torch.Generator().manual_seed(seed + i) for i in range(3)]
        plain = sampler(logits.clone(), meta).token_ids
        meta.generators = [torch.Generator().manual_seed(seed + i) for i in range(3)]
        spec = verify(sampler, logits.clone(), meta, [[], [], []]).token_ids
        assert [t[0] for t in spec] == plain


# ---- greedy: identical to decoding without speculation ------------------------------------------
def test_greedy_ngram_equals_plain_on_32_prompts(llm_fp32, ngram_llm):
    sp = SamplingParams(temperature=0, max_tokens=32)
    prompts = prompts_32()
    plain = llm_fp32.generate(prompts, sp, use_tqdm=False)
    before = ngram_llm.engine.stats().spec_decode.copy()
    spec = ngram_llm.generate(prompts, sp, use_tqdm=False)
    assert _tokens(spec) == _tokens(plain)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    after = ngram_llm.engine.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens > 100  # speculation really ran
    assert after.num_draft_tokens - before.num_draft_tokens > after.num_accepted_tokens - before.num_accepted_tokens
    assert ngram_llm.engine.kv_manager.pool.num_used_blocks == 0


def test_greedy_self_draft_equals_plain_on_32_prompts(llm_fp32):
    llm = LLM(dtype="float32", speculative_config=SELF_DRAFT)
    sp = SamplingParams(temperature=0, max_tokens=24)
    prompts = prompts_32()
    assert _tokens(llm.generate(prompts, sp, use_tqdm=False)) == _tokens(llm_fp32.generate(prompts, sp,
                                                                                           use_tqdm=False))
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_tiny_random_draft_with_the_same_vocabulary(llm_fp32, tmp_path, bundled_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.model.loader import load_hf_tokenizer

    tok = load_hf_tokenizer(bundled_path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=llm_fp32.engine.model_config.vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=8192, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(dtype="float32", speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2,
                                                   "backoff": False, "disable_by_batch_size": None})
    sp = SamplingParams(temperature=0, max_tokens=12)
    prompts = OTHER[:3]
    assert _tokens(llm.generate(prompts, sp, use_tqdm=False)) == _tokens(llm_fp32.generate(prompts, sp,
                                                                                           use_tqdm=False))
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0  # its (useless) guesses were all checked


# ---- sampling: the distribution of plain sampling ------------------------------------------------
def test_sampled_tokens_follow_plain_sampling_distribution(llm_fp32, ngram_llm):
    """Two-sample chi-square over 200 seeded draws each: the distribution of generated tokens 2 to 4
    (which speculation proposes and verifies) is that of plain sampling."""
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
    n = 200
    params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=4, seed=s, ignore_eos=True) for s in range(n)]
    plain = llm_fp32.generate([prompt] * n, params, use_tqdm=False)
    params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=4, seed=10_000 + s, ignore_eos=True)
              for s in range(n)]
    before = ngram_llm.engine.stats().spec_decode.copy()
    spec = ngram_llm.generate([prompt] * n, params, use_tqdm=False)
    stats = ngram_llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens - before.num_accepted_tokens > n // 2  # drafts were proposed and kept
    assert stats.num_draft_tokens - stats.num_accepted_tokens > before.num_draft_tokens - before.num_accepted_tokens
    for pos in (1, 2, 3):
        a = [o.outputs[0].token_ids[pos] for o in plain]
        b = [o.outputs[0].token_ids[pos] for o in spec]
        cats = sorted(set(a) | set(b))
        table = [[a.count(c), b.count(c)] for c in cats]
        # Pool rare categories so every expected count is at least 5.
        table.sort(key=lambda r: -(r[0] + r[1]))
        while len(table) > 2 and sum(table[-1]) < 10:
            last = table.pop()
            table[-1] = [table[-1][0] + last[0], table[-1][1] + last[1]]
        stat = 0.0
        for row in table:
            tot = row[0] + row[1]
            for j in range(2):
                e = tot * n / (2 * n)
                stat += (row[j] - e) ** 2 / e
        df = len(table) - 1
        p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                          torch.tensor(stat / 2, dtype=torch.float64)))
        assert p > 1e-3, (pos, table)


def test_seeded_sampling_with_speculation_is_reproducible(ngram_llm):
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=42)
    prompt = f"{PARAGRAPHS[0]}\n\nRepeat the text exactly:\n"
    a = ngram_llm.generate([prompt, OTHER[0]], sp, use_tqdm=False)
    b = ngram_llm.generate([OTHER[1], prompt], sp, use_tqdm=False)  # other company, other order
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids


# ---- bookkeeping ---------------------------------------------------------------------------------
def test_rollback_leaves_no_leaked_blocks_under_preemption():
    """A small pool (preemptions), chunked prefill, random max_tokens and stops: after every step each
    running request holds exactly the blocks of its computed tokens, and at the end nothing is held."""
    prompts = prompts_32()[::4]
    rng = random.Random(3)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randint(8, 40),
                             stop=rng.choice([None, ["the"], ["\n\n"]])) for i in range(len(prompts))]
    for spec in (NGRAM, SELF_DRAFT):
        llm = LLM(dtype="float32", speculative_config=spec, num_kv_blocks=12, max_num_batched_tokens=64)
        eng = llm.engine
        outs = run_checking_blocks(eng, prompts, params)
        assert eng.stats().num_preemptions > 0
        assert eng.stats().spec_decode.num_draft_tokens > 0
        for i, sp in enumerate(params):
            assert len(outs[f"r{i}"].outputs[0].token_ids) <= sp.max_tokens


def test_stops_and_max_tokens_are_exact_with_speculation(llm_fp32, ngram_llm):
    """A stop string, a stop token id or max_tokens in the middle of an accepted run of drafts ends the
    request exactly where plain decoding ends it."""
    prompt = f"{PARAGRAPHS[2]}\n{PARAGRAPHS[2]}\n{PARAGRAPHS[2][:20]}"
    base = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    cases = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 5, 7, 13)]
    cases += [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[9]]),
              SamplingParams(temperature=0, max_tokens=30, stop=[base.outputs[0].text[30:38]]),
              SamplingParams(temperature=0, max_tokens=30, stop=[base.outputs[0].text[30:38]],
                             include_stop_str_in_output=True)]
    plain = llm_fp32.generate([prompt] * len(cases), cases, use_tqdm=False)
    spec = ngram_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        assert (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason, b.outputs[0].stop_reason) \
            == (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason, a.outputs[0].stop_reason)


def test_max_model_len_is_never_exceeded():
    llm = LLM(dtype="float32", max_model_len=96, speculative_config=NGRAM)
    prompt = f"{PARAGRAPHS[0]}\n{PARAGRAPHS[0]}\n"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 96
    assert out.outputs[0].finish_reason == "length"
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_n_samples_logprobs_and_prefix_cache_with_speculation(llm_fp32, ngram_llm):
    prompt = f"{PARAGRAPHS[1]}\n\nRepeat the code exactly:\n"
    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    a = llm_fp32.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    b = ngram_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids
    for la, lb in zip(a.logprobs, b.logprobs, strict=True):
        assert list(la) == list(lb)
        for tid in la:
            assert lb[tid].logprob == pytest.approx(la[tid].logprob, abs=1e-4)
            assert lb[tid].rank == la[tid].rank
    # Only real tokens were offered to the prefix cache: each cached block's tokens are a block of some
    # prompt + output, and a rerun hits the cache and gives the same tokens.
    again = ngram_llm.generate([prompt], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == a.token_ids
    seq = again.prompt_token_ids + again.outputs[0].token_ids
    bs = ngram_llm.engine.config.block_size
    real = {tuple(seq[i : i + bs]) for i in range(0, len(seq) - bs + 1, bs)}
    cached = [blk.token_ids for blk in ngram_llm.engine.kv_manager.pool.cached.values()]
    assert sum(t in real for t in cached) >= len(seq) // bs - 1
    # n > 1 with a seed: every sample speculates on its own and finishes.
    outs = ngram_llm.generate([prompt], SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=16),
                              use_tqdm=False)[0].outputs
    assert len(outs) == 3 and all(len(o.token_ids) == 16 for o in outs)


def test_mixed_batch_of_speculating_and_plain_requests(llm_fp32, ngram_llm):
    """Greedy requests that speculate beside requests that cannot (penalties, min_tokens, a grammar) and a
    seeded sampled one: each gives what it gives alone without speculation."""
    from pagedserve.sampling_params import StructuredOutputsParams

    copy = f"{PARAGRAPHS[3]}\n\nRepeat the text exactly:\n"
    reqs = [
        (copy, SamplingParams(temperature=0, max_tokens=24)),
        (copy, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)),
        (copy, SamplingParams(temperature=0, max_tokens=24, min_tokens=20)),
        (OTHER[0], SamplingParams(temperature=0, max_tokens=8,
                                  structured_outputs=StructuredOutputsParams(choice=["Paris", "Lyon"]))),
        (OTHER[2], SamplingParams(temperature=0.9, seed=11, max_tokens=16, presence_penalty=0.5)),
        (f"{PARAGRAPHS[1]}\nRepeat:\n", SamplingParams(temperature=0, max_tokens=24)),
    ]
    alone = [llm_fp32.generate([p], sp, use_tqdm=False)[0] for p, sp in reqs]
    before = ngram_llm.engine.stats().spec_decode.copy()
    mixed = ngram_llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    assert _tokens(mixed) == _tokens(alone)
    assert ngram_llm.engine.stats().spec_decode.num_accepted_tokens > before.num_accepted_tokens
    # The requests with penalties or a grammar never carried drafts.
    recs = [r for r in ngram_llm.engine.step_records if r.spec_drafts]
    assert recs
    for o in (mixed[1], mixed[3], mixed[4]):
        assert not any(o.request_id in r.spec_drafts for r in recs)


def _with_speculator(llm, speculator):
    """Swap an engine's speculator for one test (engines are expensive to build)."""
    class Swap:
        def __enter__(self):
            self.saved = llm.engine.speculator
            llm.engine.speculator = speculator
            return speculator

        def __exit__(self, *exc):
            llm.engine.speculator = self.saved

    return Swap()


def test_batches_larger_than_disable_by_batch_size_do_not_speculate(ngram_llm):
    from pagedserve.spec_decode.speculator import Speculator

    config = SpeculativeConfig.from_value({**NGRAM, "disable_by_batch_size": 2})
    copy = f"{PARAGRAPHS[0]}\n{PARAGRAPHS[0]}\n"
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with _with_speculator(ngram_llm, Speculator(config, NgramProposer(1, 3))) as spec:
        ngram_llm.generate([copy] * 3, sp, use_tqdm=False)
        assert spec.stats.num_draft_tokens == 0
        ngram_llm.generate([copy], sp, use_tqdm=False)
        assert spec.stats.num_draft_tokens > 0


def test_backoff_pauses_a_request_whose_drafts_fail(llm_fp32, ngram_llm):
    from pagedserve.spec_decode.speculator import Speculator

    class Wrong:  # proposes a token the target never emits
        def propose(self, batch):
            return {req.request_id: [0] * k for req, k in batch}

        def on_verified(self, *a):
            pass

        def drop(self, rid):
            pass

    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    first = ngram_llm.engine.step_count
    with _with_speculator(ngram_llm, Speculator(SpeculativeConfig.from_value(NGRAM), Wrong())) as spec:
        out = ngram_llm.generate([OTHER[0]], sp, use_tqdm=False)[0]
    assert spec.stats.num_draft_tokens > 0 and spec.stats.num_accepted_tokens == 0
    proposing_steps = sum(1 for r in ngram_llm.engine.step_records if r.step >= first and r.num_spec_tokens)
    assert proposing_steps <= 7  # 2 misses, then pauses of 2, 4, 8, 16, 32 steps
    assert out.outputs[0].token_ids == llm_fp32.generate([OTHER[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
