"""Scheduler unit tests without a model: budget, chunked prefill, admission order, preemption, stops."""

from __future__ import annotations

import pytest
from sched_helpers import update

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.sampling_params import SamplingParams

EOS = 2


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8, max_model_len: int = 256,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(budget, max_seqs, max_model_len), kv)


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 8, first: int = 10, **params) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    req = Request(rid, [first + i for i in range(prompt_len)], sp, frozenset({EOS}), max_tokens)
    sched.add_request(req)
    return req


def run_step(sched: Scheduler, token: int = 5) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.scheduled if s.sample}
    return out, update(sched, out, sampled)


def test_config_validation():
    for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        kwargs = {name: 0}
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**kwargs)


def test_rejects_requests_that_can_never_run():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len"):
        add(sched, "long", 15, max_tokens=6)
    sched2 = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="KV blocks"):
        add(sched2, "big", 15, max_tokens=2)  # 17 tokens → 5 blocks > 4
    add(sched2, "ok", 14, max_tokens=2)  # exactly 16 tokens fits
    assert not sched.has_unfinished_requests()
    assert "long" not in sched.requests


def test_prefill_then_decode_one_token_per_step():
    sched = make_scheduler()
    req = add(sched, "a", 10, max_tokens=3)
    out, _ = run_step(sched)
    assert [(s.request_id, len(s.token_ids), s.start_pos, s.sample, s.is_prefill) for s in out.scheduled] == [
        ("a", 10, 0, True, True)
    ]
    assert out.num_prefill_tokens == 10 and out.num_decode_tokens == 0
    out, _ = run_step(sched)
    s = out.scheduled[0]
    assert (len(s.token_ids), s.start_pos, s.sample, s.is_prefill) == (1, 10, True, False)
    assert out.num_decode_tokens == 1
    out, finished = run_step(sched)
    assert finished == [req]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [5, 5, 5]
    assert sched.kv.pool.num_used_blocks == 0
    assert not sched.has_unfinished_requests()


def test_chunked_prefill_splits_prompt_over_steps():
    sched = make_scheduler(budget=16)
    req = add(sched, "a", 40, max_tokens=2)
    chunks = []
    while not req.output_token_ids:
        out, _ = run_step(sched)
        assert out.num_scheduled_tokens <= 16
        (s,) = out.scheduled
        chunks.append((s.start_pos, len(s.token_ids), s.sample))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert req.num_computed_tokens == 40


def test_running_first_then_waiting_share_one_budget():
    sched = make_scheduler(budget=10)
    a = add(sched, "a", 4, max_tokens=5)
    run_step(sched)  # a prefilled
    add(sched, "b", 20, max_tokens=2)
    out, _ = run_step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_scheduled_tokens == 10
    assert a.num_output_tokens == 2


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", 4, max_tokens=3)
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        assert len(out.scheduled) <= 2 and len(sched.running) <= 2


def test_first_come_first_served_no_overtaking():
    sched = make_scheduler(num_blocks=6, block_size=4, caching=False)
    add(sched, "a", 16, max_tokens=4)  # 4 blocks + decode
    add(sched, "b", 12, max_tokens=4)  # 3 blocks: does not fit next to a
    add(sched, "c", 2, max_tokens=1)  # would fit, but must not overtake b
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv.pool.num_used_blocks == 0


def test_prefix_lookups_count_once_per_admission():
    """A head of the queue that waits for blocks over several steps is counted once, when admitted."""
    sched = make_scheduler(num_blocks=6, block_size=4)
    add(sched, "a", 16, max_tokens=4, first=100)
    add(sched, "b", 12, max_tokens=2, first=10)
    for _ in range(3):
        run_step(sched)
    assert sched.kv.prefix_queries == 16
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv.prefix_queries == 16 + 12


def test_preemption_frees_newest_and_requeues_it_first():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    a = add(sched, "a", 8, max_tokens=8)
    b = add(sched, "b", 8, max_tokens=8)
    add(sched, "c", 3, max_tokens=1)
    run_step(sched)  # a: 2 blocks, b: 2 blocks; c waits (1 block free but...)
    assert {r.request_id for r in sched.running} >= {"a", "b"}
    preempted_seen = None
    for _ in range(20):
        out, _ = run_step(sched)
        if out.preempted:
            preempted_seen = out
            break
    assert preempted_seen is not None
    victim = sched.requests[preempted_seen.preempted[0]] if preempted_seen.preempted[0] in sched.requests else None
    assert victim is not None
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert sched.waiting[0] is victim
    assert victim.request_id not in sched.kv.req_blocks
    assert victim is not a  # the oldest running request is never the victim of another
    # No new admission in a step that preempted.
    assert all(s.request_id in {r.request_id for r in sched.running} for s in preempted_seen.scheduled)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert a.is_finished and b.is_finished
    assert a.output_token_ids == [5] * 8 and b.output_token_ids == [5] * 8
    assert sched.kv.pool.num_used_blocks == 0


def test_identical_block_aligned_prompts_never_cache_the_last_token():
    sched = make_scheduler(block_size=4)
    a = add(sched, "a", 16, max_tokens=2)
    b = add(sched, "b", 16, max_tokens=2)
    out, _ = run_step(sched)
    by_id = {s.request_id: s for s in out.scheduled}
    assert len(by_id["a"].token_ids) == 16
    # b shares a's first three blocks (cached this step) and computes its last block itself.
    assert by_id["b"].start_pos == 12 and len(by_id["b"].token_ids) == 4
    assert by_id["b"].block_table[:3] == by_id["a"].block_table[:3]
    assert by_id["b"].block_table[3] != by_id["a"].block_table[3]
    assert out.num_cached_tokens == 12 and b.num_cached_tokens == 12 and a.num_cached_tokens == 0
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (32, 12)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv.pool.num_used_blocks == 0


def test_stop_conditions():
    sched = make_scheduler()
    eos = add(sched, "eos", 4, max_tokens=5)
    stop_tok = add(sched, "stoptok", 4, max_tokens=5, stop_token_ids=[7])
    ignore = add(sched, "ignore", 4, max_tokens=3, ignore_eos=True)
    out = sched.schedule()
    update(sched, out, {"eos": EOS, "stoptok": 7, "ignore": EOS})
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_tok.status == RequestStatus.FINISHED_STOPPED and stop_tok.stop_reason == 7
    assert ignore.status == RequestStatus.RUNNING
    while sched.has_unfinished_requests():
        run_step(sched, token=EOS)
    assert ignore.status == RequestStatus.FINISHED_LENGTH and ignore.num_output_tokens == 3


def test_min_tokens_suppresses_early_stop():
    sched = make_scheduler()
    req = add(sched, "a", 4, max_tokens=6, min_tokens=3, stop_token_ids=[7])
    for expected_outputs in (1, 2):
        out = sched.schedule()
        update(sched, out, {"a": EOS if expected_outputs == 1 else 7})
        assert req.status == RequestStatus.RUNNING
    out = sched.schedule()
    update(sched, out, {"a": EOS})
    assert req.status == RequestStatus.FINISHED_STOPPED and req.num_output_tokens == 3


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=12)
    req = add(sched, "a", 6, max_tokens=6)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.num_tokens == 12


def test_finish_waiting_and_running_requests_frees_blocks():
    sched = make_scheduler(max_seqs=1)
    a = add(sched, "a", 9, max_tokens=4)
    b = add(sched, "b", 9, max_tokens=4)
    run_step(sched)
    assert sched.kv.pool.num_used_blocks == 3
    sched.finish(b, RequestStatus.FINISHED_ABORTED)  # waiting
    sched.finish(a, RequestStatus.FINISHED_ABORTED)  # running
    sched.finish(a, RequestStatus.FINISHED_ABORTED)  # idempotent
    assert a.status.finish_reason == "abort"
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in sched.kv.pool.blocks)
    assert sched.schedule().is_empty
