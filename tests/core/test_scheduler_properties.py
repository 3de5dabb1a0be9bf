"""Property-based tests of the scheduler + KV cache manager with a fake model (hypothesis).

The fake model writes, for every computed token, a fingerprint of the whole prefix up to it into the
slot its block table maps it to (as a real model writes K/V), and before sampling reads the request's
whole context back through its block table. So a block shared by prefix caching must hold exactly the
right prefix, a preempted request must be recomputed correctly, and no request may scribble on a block
another request reads. The sampled token is a deterministic function of that context, so every request's
output must equal what it would produce alone, whatever the arrivals, budget and cache size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_helpers import update

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.sampling_params import SamplingParams

VOCAB = 32
EOS = 0
MOD = (1 << 61) - 1


def extend(h: int, token: int, pos: int) -> int:
    return (h * 1_000_003 + token * 7919 + pos + 1) % MOD


def next_token(h: int) -> int:
    return (h >> 11) % VOCAB


def prefix_fingerprints(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for pos, t in enumerate(tokens):
        h = extend(h, t, pos)
        out.append(h)
    return out


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int, ignore_eos: bool) -> list[int]:
    """What the fake model generates for this request alone."""
    tokens = list(prompt)
    h = prefix_fingerprints(tokens)[-1]
    out: list[int] = []
    while True:
        t = next_token(h)
        out.append(t)
        tokens.append(t)
        if (t == EOS and not ignore_eos) or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out
        h = extend(h, t, len(tokens) - 1)


@dataclass
class Spec:
    arrival: int
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool


class FakeEngine:
    def __init__(self, cfg: SchedulerConfig, num_blocks: int, block_size: int, caching: bool,
                 spec_k: int = 0, spec_seed: int = 0) -> None:
        """spec_k > 0: decoding requests carry up to spec_k draft tokens, each the true next token with
        probability 0.7 (speculative decoding as the engine does it: drafts scheduled and verified)."""
        self.spec_k = spec_k
        self.rng = random.Random(spec_seed)
        self.num_accepted = 0
        self.cfg = cfg
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(cfg, self.kv)
        self.bs = block_size
        self.slots: dict[int, int] = {}  # slot → fingerprint of the prefix ending at that token
        self.all: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        self.max_seen_running = 0

    def add(self, rid: str, spec: Spec) -> None:
        params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
        req = Request(rid, spec.prompt, params, frozenset({EOS}), spec.max_tokens)
        self.sched.add_request(req)
        self.all[rid] = req

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    def propose(self) -> None:
        for req in self.sched.running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue
            room = min(self.spec_k, req.max_tokens - req.num_output_tokens - 1,
                       self.cfg.max_model_len - req.num_tokens - 1)
            seq = list(req.all_token_ids)
            drafts = []
            for _ in range(max(room, 0)):
                true = next_token(prefix_fingerprints(seq)[-1])
                drafts.append(true if self.rng.random() < 0.7 else self.rng.randrange(VOCAB))
                seq.append(drafts[-1])
            req.spec_token_ids = drafts

    def step(self) -> None:
        if self.spec_k:
            self.propose()
        out = self.sched.schedule()
        cfg = self.cfg
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert out.num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len(self.sched.running) <= cfg.max_num_seqs
        assert not set(ids) & set(out.preempted)
        if self.sched.has_unfinished_requests():
            assert out.scheduled, "unfinished requests but nothing scheduled: the scheduler is stuck"
        self.num_preemptions += len(out.preempted)
        self.num_cached_tokens += out.num_cached_tokens
        check_blocks(self.kv, self.sched, {s.request_id: len(s.token_ids) for s in out.scheduled})

        # "Run the model": write every new token's fingerprint first, then read contexts back.
        fingerprints = {}
        for s in out.scheduled:
            req = self.all[s.request_id]
            assert s.token_ids, "empty chunk scheduled"
            assert s.start_pos == req.num_computed_tokens
            end = s.start_pos + len(s.token_ids)
            nd = len(s.spec_token_ids)
            real_end = end - nd
            assert real_end <= req.num_tokens
            assert s.token_ids == req.all_token_ids[s.start_pos : real_end] + s.spec_token_ids
            assert s.sample == (real_end == req.num_tokens)
            if nd:  # drafts ride only on a decode, within max_tokens and max_model_len
                assert len(s.token_ids) == nd + 1 and s.sample
                assert req.num_output_tokens + nd + 1 <= req.max_tokens
                assert req.num_tokens + nd + 1 <= cfg.max_model_len
            assert len(s.block_table) * self.bs >= end
            fp = prefix_fingerprints(req.all_token_ids[:real_end] + s.spec_token_ids)
            fingerprints[s.request_id] = fp
            for pos in range(s.start_pos, end):
                self.slots[self.slot(s.block_table, pos)] = fp[pos]
        sampled = {}
        for s in out.scheduled:
            end = s.start_pos + len(s.token_ids)
            fp = fingerprints[s.request_id]
            context = [self.slots.get(self.slot(s.block_table, pos)) for pos in range(end)]
            assert context == fp, f"{s.request_id}: KV cache holds the wrong context"
            if s.sample and s.spec_token_ids:  # verify: keep drafts while they are the true next token
                tokens = []
                for j in range(len(s.spec_token_ids) + 1):
                    tokens.append(next_token(fp[end - 1 - len(s.spec_token_ids) + j]))
                    if j < len(s.spec_token_ids) and tokens[-1] != s.spec_token_ids[j]:
                        break
                self.num_accepted += len(tokens) - 1
                sampled[s.request_id] = tokens
            elif s.sample:
                sampled[s.request_id] = next_token(fp[-1])
        finished = update(self.sched, out, sampled)
        for req in finished:
            assert req.is_finished
            assert req.request_id not in self.kv.req_blocks
        check_blocks(self.kv, self.sched, {})
        self.max_seen_running = max(self.max_seen_running, len(self.sched.running))


def check_blocks(kv: KVCacheManager, sched: Scheduler, in_flight: dict[str, int]) -> None:
    pool = kv.pool
    owners: dict[int, int] = {}
    running = {r.request_id for r in sched.running}
    for rid, blocks in kv.req_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
        for b in ids:
            owners[b] = owners.get(b, 0) + 1
        if blocks:
            assert rid in running, f"{rid} holds blocks but is not running"
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        # Exactly the blocks for the computed tokens plus those about to be computed: no leak.
        tokens = r.num_computed_tokens + in_flight.get(r.request_id, 0)
        assert len(kv.req_blocks.get(r.request_id, [])) == kv.blocks_needed(tokens), r.request_id
    for r in sched.waiting:
        assert not kv.req_blocks.get(r.request_id), "a waiting/preempted request holds blocks"
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    free_ids = set(pool.free)
    for b in pool.blocks:
        n = owners.get(b.block_id, 0)
        assert b.ref_count == n, f"block {b.block_id}: ref_count {b.ref_count} but {n} owners"
        if n > 1:
            assert b.block_hash is not None, f"block {b.block_id} shared but not a cached block"
        assert (b.ref_count == 0) == (b.block_id in free_ids)
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert pool.num_used_blocks == len(owners)
    for h, b in pool.cached.items():
        assert b.block_hash == h


def run_simulation(
    specs: list[Spec], *, block_size: int, num_blocks: int, budget: int, max_seqs: int, max_model_len: int,
    caching: bool, max_steps: int = 20_000, spec_k: int = 0, spec_seed: int = 0,
) -> FakeEngine:
    cfg = SchedulerConfig(budget, max_seqs, max_model_len)
    eng = FakeEngine(cfg, num_blocks, block_size, caching, spec_k, spec_seed)
    pending = sorted(enumerate(specs), key=lambda x: x[1].arrival)
    accepted: dict[str, Spec] = {}
    step = 0
    while pending or eng.sched.has_unfinished_requests():
        while pending and pending[0][1].arrival <= step:
            i, spec = pending.pop(0)
            total = len(spec.prompt) + spec.max_tokens
            fits = total <= max_model_len and -(-total // block_size) <= num_blocks
            rid = f"r{i}"
            if fits:
                eng.add(rid, spec)
                accepted[rid] = spec
            else:
                with pytest.raises(ValueError):
                    eng.add(rid, spec)
                assert not eng.sched.requests.get(rid)
        if eng.sched.has_unfinished_requests():
            eng.step()
        step += 1
        assert step < max_steps, "simulation did not finish"
    # Everything finished, with the output it would have had alone, and every block is free.
    for rid, spec in accepted.items():
        req = eng.all[rid]
        assert req.is_finished
        assert req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        expected = reference_output(spec.prompt, spec.max_tokens, max_model_len, spec.ignore_eos)
        assert req.output_token_ids == expected, rid
        if req.status == RequestStatus.FINISHED_STOPPED:
            assert expected[-1] == EOS and not spec.ignore_eos
    pool = eng.kv.pool
    assert pool.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not eng.kv.req_blocks and not eng.kv.req_hashes
    assert not eng.sched.requests and not eng.sched.running and not eng.sched.waiting
    return eng


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_blocks = draw(st.integers(2, 48))
    budget = draw(st.integers(1, 64))
    max_seqs = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(8, 96))
    caching = draw(st.booleans())
    prefixes = draw(
        st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=40), min_size=1, max_size=3)
    )
    specs = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes + [[]]))
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1, max_size=24))
        specs.append(
            Spec(
                arrival=draw(st.integers(0, 12)),
                prompt=prefix + suffix,
                max_tokens=draw(st.integers(1, 24)),
                ignore_eos=draw(st.booleans()),
            )
        )
    return dict(
        specs=specs, block_size=block_size, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs,
        max_model_len=max_model_len, caching=caching,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_outputs(w):
    run_simulation(**w)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 5), st.integers(0, 2**16))
def test_speculative_decoding_keeps_invariants_and_outputs(w, spec_k, seed):
    """Draft tokens (some right, some wrong) on every decode: the same outputs as plain decoding, no step
    over budget, and after every step exactly the blocks of the computed tokens (rejected drafts' lookahead
    slots returned)."""
    run_simulation(**w, spec_k=spec_k, spec_seed=seed)


def test_speculative_decoding_accepts_and_preempts():
    specs = [Spec(0, [1 + (i * 7 + j) % 30 for j in range(20)], 24, True) for i in range(4)]
    eng = run_simulation(specs, block_size=4, num_blocks=14, budget=64, max_seqs=4, max_model_len=64,
                         caching=True, spec_k=3, spec_seed=1)
    assert eng.num_preemptions > 0 and eng.num_accepted > 20


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(1, VOCAB - 1), min_size=4, max_size=30),
    st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8), min_size=2, max_size=6),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 24),
)
def test_small_cache_preempts_and_still_matches(prefix, suffixes, block_size, budget):
    """Caches barely larger than one request: preemption (and recompute) is the common case."""
    specs = [Spec(0, prefix + s, 12, True) for s in suffixes]
    longest = max(len(s.prompt) for s in specs) + 12
    num_blocks = -(-longest // block_size) + 1
    for caching in (False, True):
        run_simulation(
            specs, block_size=block_size, num_blocks=num_blocks, budget=budget, max_seqs=8,
            max_model_len=128, caching=caching,
        )


def test_small_cache_really_preempts():
    specs = [Spec(0, [1 + (i * 7 + j) % 30 for j in range(20)], 16, True) for i in range(4)]
    eng = run_simulation(specs, block_size=4, num_blocks=12, budget=64, max_seqs=4, max_model_len=64,
                         caching=False)
    assert eng.num_preemptions > 0


def test_shared_prefixes_hit_the_cache():
    prefix = list(range(1, 17))
    specs = [Spec(i, prefix + [20 + i], 4, True) for i in range(4)]
    eng = run_simulation(specs, block_size=4, num_blocks=64, budget=64, max_seqs=4, max_model_len=64,
                         caching=True)
    assert eng.num_cached_tokens >= 3 * 16
    eng = run_simulation(specs, block_size=4, num_blocks=64, budget=64, max_seqs=4, max_model_len=64,
                         caching=False)
    assert eng.num_cached_tokens == 0
