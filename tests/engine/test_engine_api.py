"""LLMEngine's read API (stats, get_request, live_requests) and its controls (abort_all,
reset_prefix_cache): what metrics, bench, trace, explain, chat and the dashboard use instead of the
scheduler's and the block pool's fields."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams

pytestmark = pytest.mark.slow


def test_stats_and_requests_follow_a_run(llm_fp32):
    engine = llm_fp32.engine
    before = engine.stats()
    assert before.num_running == before.num_waiting == before.num_unfinished_requests == 0
    assert before.num_used_blocks == 0 and before.kv_cache_usage == 0.0
    prompt = {"prompt_token_ids": list(range(1000, 1040))}
    engine.add_request("api-a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("api-b", prompt, SamplingParams(temperature=0, max_tokens=3, n=2, ignore_eos=True))
    s = engine.stats()
    assert (s.num_waiting, s.num_running, s.num_unfinished_requests) == (3, 0, 2)
    assert s.num_prompt_tokens - before.num_prompt_tokens == 80
    info = engine.get_request("api-b#1")
    assert info.parent_id == "api-b" and info.status == "waiting" and info.max_tokens == 3
    assert not info.holds_blocks and info.num_computed_tokens == 0
    engine.step()
    s = engine.stats()
    assert s.num_running == 3 and s.num_waiting == 0 and s.num_used_blocks > 0
    assert s.kv_cache_usage == s.num_used_blocks / s.num_kv_blocks
    assert [r.request_id for r in engine.live_requests()] == ["api-a", "api-b#0", "api-b#1"]
    assert engine.get_request("api-a").holds_blocks and engine.get_request("api-a").num_output_tokens == 1
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    assert after.num_generation_tokens - before.num_generation_tokens == 4 + 3 + 3
    assert after.finished_by_reason["length"] - before.finished_by_reason["length"] == 3
    assert engine.get_request("api-a") is None and not engine.live_requests()
    assert after.num_used_blocks == 0 and after.num_cached_free_blocks > 0  # the prompt's blocks stay cached
    engine.reset_prefix_cache()
    assert engine.stats().num_cached_free_blocks == 0
    assert engine.stats().num_free_blocks == after.num_kv_blocks


def test_abort_all_frees_everything(llm_fp32):
    engine = llm_fp32.engine
    aborted0 = engine.stats().finished_by_reason["abort"]
    for i in range(3):
        engine.add_request(f"all-{i}", {"prompt_token_ids": [7 + i] * 20},
                           SamplingParams(max_tokens=50, n=2, seed=i, temperature=0.9))
    engine.step()
    assert len(engine.generators) == 6  # one per seeded sample
    outs = engine.abort_all()
    assert len(engine.generators) == 0  # dropped with their requests
    assert sorted(o.request_id for o in outs) == ["all-0", "all-1", "all-2"]
    assert all(o.finished and {c.finish_reason for c in o.outputs} == {"abort"} for o in outs)
    s = engine.stats()
    assert s.num_unfinished_requests == s.num_running == s.num_waiting == s.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    engine.step()  # the aborts are reported in the next step record
    assert s.finished_by_reason["abort"] - aborted0 == 6
    assert engine.abort_all() == []


def test_block_tables_are_kept_for_the_newest_steps_only():
    """A server keeps block tables only for the dashboard's window: memory stays bounded."""
    from pagedserve import LLM

    llm = LLM(dtype="float32", keep_block_tables=True, max_block_table_records=3, max_step_records=6,
              num_scheduler_steps=1)  # a server's single steps
    llm.generate(["Keep counting: one two"], SamplingParams(temperature=0, max_tokens=9), use_tqdm=False)
    recs = list(llm.engine.step_records)
    assert len(recs) == 6  # max_step_records
    assert [r.block_tables is not None for r in recs] == [False, False, False, True, True, True]
    with pytest.raises(ValueError, match="max_block_table_records"):
        LLM(dtype="float32", max_block_table_records=0)
