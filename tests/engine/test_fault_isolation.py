"""A step that fails for one request fails only that request (issue 12): the engine runs the step's
requests one by one, aborts the one(s) that fail again with the error, and the others go on with
exactly the tokens they produce without the faulty neighbour."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sampling.sampler import Sampler

pytestmark = pytest.mark.slow

PROMPTS = [f"Item {i}: the quick brown fox" for i in range(8)]
POISON = 0.0123  # a frequency_penalty only the faulty request uses


@pytest.fixture
def poisoned_sampling(monkeypatch):
    """Sampling raises for any batch holding the faulty request (its penalty marks it)."""
    real = Sampler._apply_penalties

    def apply(logits, penalties):
        if any(p.frequency == POISON for p in penalties):
            raise RuntimeError("injected sampling failure")
        return real(logits, penalties)

    monkeypatch.setattr(Sampler, "_apply_penalties", staticmethod(apply))


def test_one_failing_request_leaves_the_other_seven_intact(llm_fp32, poisoned_sampling):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    params = [greedy] * 6 + [seeded]
    expected = [o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS[:7], params, use_tqdm=False)]
    faulty = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=POISON)
    aborted0 = llm_fp32.engine.stats().finished_by_reason["abort"]
    outs = llm_fp32.generate(PROMPTS[:3] + [PROMPTS[7]] + PROMPTS[3:7], params[:3] + [faulty] + params[3:],
                             use_tqdm=False)
    bad = outs.pop(3)
    assert bad.error and "injected sampling failure" in bad.error
    assert bad.outputs[0].finish_reason == "abort" and bad.finished
    assert [o.outputs[0].token_ids for o in outs] == expected  # the seeded one included
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    s = llm_fp32.engine.stats()
    assert s.finished_by_reason["abort"] - aborted0 == 1
    assert s.num_running == s.num_waiting == s.num_used_blocks == 0


def test_a_failure_for_everyone_aborts_everyone_and_the_engine_goes_on(llm_fp32, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("model is broken")

    llm = llm_fp32
    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert all(o.error and "model is broken" in o.error and o.outputs[0].finish_reason == "abort" for o in outs)
    monkeypatch.undo()
    assert llm.engine.stats().num_used_blocks == 0
    again = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert again.error is None and len(again.outputs[0].token_ids) == 4


def test_sampled_ids_never_leave_the_vocabulary():
    from pagedserve.kernels import CpuKernels
    from pagedserve.sampling.metadata import SamplingMetadata

    class Row:  # the least a request needs for SamplingMetadata
        def __init__(self, temperature: float) -> None:
            self.sampling_params = SamplingParams(temperature=temperature)
            self.output_token_ids, self.prompt_token_ids, self.eos_token_ids = [], [1], frozenset()
            self.num_output_tokens = 0

    logits = torch.randn(3, 50)
    logits[1] = float("nan")
    for kernels in (None, CpuKernels.build()):
        for temperature in (0.0, 0.8):
            meta = SamplingMetadata.from_requests([Row(temperature)] * 3)
            try:
                out = Sampler(0, kernels)(logits, meta)
            except ValueError as e:  # the row is named; the engine then fails only that request
                assert "row 1" in str(e)
            else:
                assert all(0 <= t < 50 for t in out.token_ids)


def test_fault_isolation_is_not_needed_by_a_healthy_batch():
    """The isolation path is for failures only: a healthy engine never takes it (it would cost a forward
    per request)."""
    llm = LLM(dtype="float32", max_num_seqs=8)
    calls = []
    real = llm.engine._execute_one_by_one
    llm.engine._execute_one_by_one = lambda *a: calls.append(1) or real(*a)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert calls == []
