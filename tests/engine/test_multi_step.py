"""Multi-step decoding (EngineConfig.num_scheduler_steps): runs of greedy decode steps in one scheduling step give
the tokens, texts and finish reasons of one step at a time (stops and max_tokens cut where single steps stop), fall
back to single steps where a request needs more than the argmax or the blocks run short, and leave the KV cache's
bookkeeping as single steps do."""

from __future__ import annotations

import pytest
from sched_helpers import run_checking_blocks

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.llm import OFFLINE_SCHEDULER_STEPS

PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "List the days of the week:",
           "Water boils at", "1, 2, 3, 4, 5,"]
# max_tokens not multiples of the run length, a stop string, stop ids, EOS (SmolLM2 stops some of these early)
PARAMS = [SamplingParams(temperature=0, max_tokens=37),
          SamplingParams(temperature=0, max_tokens=23, stop=["."]),
          SamplingParams(temperature=0, max_tokens=29, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[28]),
          SamplingParams(temperature=0, max_tokens=9, include_stop_str_in_output=True, stop=[" degrees"]),
          SamplingParams(temperature=0, max_tokens=45)]


def _run(llm: LLM, prompts=PROMPTS, params=PARAMS):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _multi_steps(llm: LLM) -> list[int]:
    return [r.num_steps for r in llm.engine.step_records if r.num_steps > 1]


@pytest.fixture(scope="module", params=["auto", "float32"])
def pair(request):
    """(one step at a time, runs of up to 5) on the same weights: auto is bf16 where the CPU has it (the fused
    greedy head), float32 the head's logits then the sampler's argmax."""
    return (LLM(dtype=request.param, num_scheduler_steps=1), LLM(dtype=request.param, num_scheduler_steps=5))


@pytest.mark.parametrize("value", [0, 65, 2.0, True, "8"])
def test_bad_num_scheduler_steps_names_the_field(value):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=value)


def test_defaults_generate_runs_a_stepped_engine_single_steps():
    """LLM.generate runs OFFLINE_SCHEDULER_STEPS in a row unless told; an engine that its caller steps (a server)
    takes one step at a time unless told."""
    llm = LLM(dtype="float32")
    assert llm.engine.num_scheduler_steps == 1 and llm.num_scheduler_steps == OFFLINE_SCHEDULER_STEPS
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert max(r.num_steps for r in llm.engine.step_records) == OFFLINE_SCHEDULER_STEPS
    assert llm.engine.num_scheduler_steps == 1  # (restored after the call)
    llm.engine.add_request("stepped", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    before = len(llm.engine.step_records)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert [r.num_steps for r in list(llm.engine.step_records)[before:]] == [1] * 12
    assert LLMEngine(EngineConfig(dtype="float32")).num_scheduler_steps == 1
    assert LLMEngine(EngineConfig(dtype="float32", num_scheduler_steps=4)).num_scheduler_steps == 4


def test_same_outputs_as_single_steps(pair):
    single, multi = pair
    want = _run(single)
    got = _run(multi)
    assert got == want
    assert {r.num_steps for r in single.engine.step_records} == {1}
    runs = _multi_steps(multi)
    assert runs and max(runs) == 5  # it ran runs (and shorter ones where max_tokens left fewer)
    # the stops cut the runs: some request finished in the middle of one
    assert any(f == "stop" for _, _, f in want) and any(f == "length" for _, _, f in want)
    # the step records count the tokens whose K/V each request kept (a cut run: the tokens it took), so a finished
    # request computed all its tokens but the last, as with single steps (no prefix hits: prompts under a block)
    for llm in (single, multi):
        first = llm.engine.step_count
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        recs = [r for r in llm.engine.step_records if r.step >= first]
        for o in outs:
            computed = sum(r.scheduled.get(o.request_id, 0) for r in recs)
            assert computed == len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1, o.request_id


def test_one_request_alone_and_many_rows(pair):
    """One sequence (the W2 shape) and more than the few-rows GEMV's 4 rows in a run."""
    single, multi = pair
    alone = [SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)]
    assert _run(multi, PROMPTS[:1], alone) == _run(single, PROMPTS[:1], alone)
    many = PROMPTS + [p + " and" for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)] * len(many)
    assert _run(multi, many, params) == _run(single, many, params)


def test_requests_that_need_more_than_the_argmax_take_single_steps(pair):
    single, multi = pair
    mixed = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=14, logprobs=2, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=18, min_tokens=10, stop_token_ids=[28])]
    for sp in mixed[1:]:
        before = len(multi.engine.step_records)
        prompts, params = PROMPTS[:2], [mixed[0], sp]
        outs_multi = multi.generate(prompts, params, use_tqdm=False)
        outs_single = single.generate(prompts, params, use_tqdm=False)
        records = list(multi.engine.step_records)[before:]
        if sp.min_tokens:  # single steps until it has min_tokens (then it is plain greedy too)
            assert [r.num_steps for r in records[: sp.min_tokens]] == [1] * sp.min_tokens
            assert any(r.num_steps > 1 and len(r.scheduled) == 2 for r in records)
        else:  # while the other request runs, every step is a single one
            assert all(r.num_steps == 1 or len(r.scheduled) == 1 for r in records)
        assert outs_multi[0].outputs[0].token_ids == outs_single[0].outputs[0].token_ids
        if sp.greedy:
            assert outs_multi[1].outputs[0].token_ids == outs_single[1].outputs[0].token_ids
        if sp.logprobs:
            assert len(outs_multi[1].outputs[0].logprobs) == len(outs_multi[1].outputs[0].token_ids)


def test_blocks_short_for_the_lookahead_fall_back_and_nothing_leaks():
    """A small pool: a run needs the slots of all its tokens up front; where they are short the step is a
    single one. After every step each running request holds the blocks of its computed tokens only, and at the
    end nothing is held."""
    prompts = [p * 3 for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=30 + 3 * i, ignore_eos=i % 2 == 0, stop=["\n\n"])
              for i in range(len(prompts))]
    want = _run(LLM(dtype="float32", num_kv_blocks=14, num_scheduler_steps=1, max_num_batched_tokens=64),
                prompts, params)
    llm = LLM(dtype="float32", num_kv_blocks=14, num_scheduler_steps=8, max_num_batched_tokens=64)
    outs = run_checking_blocks(llm.engine, prompts, params)
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
           for o in (outs[f"r{i}"] for i in range(len(prompts)))]
    assert got == want
    assert _multi_steps(llm)  # runs where the blocks allowed


def test_prefix_cache_after_a_run_cut_by_a_stop(pair):
    """A run that a stop cut wrote K/V past the request's last token; the blocks the prefix cache keeps hold real
    tokens only: a later prompt that extends the first one's tokens reuses them with the same tokens as single
    steps."""
    single, multi = pair
    prompt = single.get_tokenizer().encode(" ".join(PROMPTS) * 2)
    first = SamplingParams(temperature=0, max_tokens=40, stop=[" March"])
    got = {}
    for name, llm in (("single", single), ("multi", multi)):
        out = llm.generate([{"prompt_token_ids": prompt}], [first], use_tqdm=False)[0].outputs[0]
        hits = llm.engine.kv_manager.prefix_hits
        follow = llm.generate([{"prompt_token_ids": prompt + list(out.token_ids) + prompt[:20]}],
                              [SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)], use_tqdm=False)
        assert llm.engine.kv_manager.prefix_hits - hits >= len(prompt) // 16 * 16
        got[name] = (out.token_ids, out.finish_reason, follow[0].outputs[0].token_ids)
    assert got["multi"] == got["single"]
    assert got["single"][1] == "stop"


def test_a_nan_in_the_middle_of_a_run_fails_only_its_request(monkeypatch):
    """A token whose embedding is NaN, fed back in the middle of a run: its row's logits are NaN (argmax -1), the
    run fails, the engine runs each request alone one step at a time, and only that request ends, with the error
    single steps give it; the others get the tokens of a clean run. On every build: the AVX2 one's float32 route
    once turned the NaN logits into token 0 (argmax_rows' plain scan)."""
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for steps in (1, 6):
        llm = LLM(dtype="float32", num_scheduler_steps=steps)
        clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        others = {t for i, toks in enumerate(clean) if i != 2 for t in toks}
        others |= {t for p in prompts for t in llm.get_tokenizer().encode(p)}
        poison = next(t for t in clean[2][5:20] if t not in others)  # generated by request 2 only, mid-run
        model = llm.engine.runner.model
        real = model._input_embeddings

        def embed(ids, real=real, poison=poison):
            x = real(ids)
            x[ids == poison] = float("nan")
            return x

        monkeypatch.setattr(model, "_input_embeddings", embed)
        outs = llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.undo()
        bad = outs.pop(2)
        assert [o.outputs[0].token_ids for o in outs] == clean[:2] + clean[3:]
        assert all(o.error is None for o in outs)
        assert llm.engine.stats().num_used_blocks == 0
        results[steps] = (bad.outputs[0].token_ids, bad.outputs[0].finish_reason, bad.error)
        assert bad.outputs[0].finish_reason == "abort" and "non-finite" in bad.error
        assert bad.outputs[0].token_ids == clean[2][: clean[2].index(poison) + 1]  # nothing after it
    assert results[6] == results[1]
