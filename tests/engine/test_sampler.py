"""Sampler unit tests: greedy, top-k/top-p/min-p, penalties, seeds, the distribution, logprobs."""

from __future__ import annotations

import math
import random
import weakref

import pytest
import torch

from pagedserve.core.request import Request
from pagedserve.kernels import CpuKernels
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.sampler import Sampler as EngineSampler
from pagedserve.sampling_params import SamplingParams

VOCAB = 12
# Each seeded request's own generator, made at its first draw and kept with the Request object (the
# engine keeps them by request id in RequestGenerators).
_GENERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _generator(r: Request) -> torch.Generator | None:
    seed = r.sampling_params.seed
    if seed is None:
        return None
    if r not in _GENERATORS:
        _GENERATORS[r] = torch.Generator().manual_seed(seed)
    return _GENERATORS[r]


class Sampler(EngineSampler):
    """The engine's sampler, fed the way the engine feeds it: SamplingMetadata built from the requests."""

    def __call__(self, logits, requests):
        # Fresh logits per call, as every engine step has (the sampler adjusts them in place).
        return super().__call__(logits.clone(),
                                SamplingMetadata.from_requests(requests, [_generator(r) for r in requests]))


def apply_penalties(logits, requests):
    return EngineSampler._apply_penalties(logits, SamplingMetadata.from_requests(requests).penalties)


def req(rid: str = "r", prompt=(1, 2, 3), outputs=(), eos=frozenset({0}), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos, max_tokens=64)
    for t in outputs:
        r.append_output_token(t)
    return r


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = Sampler()(logits, [req(str(i), temperature=0) for i in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = random_logits(4)
    reqs = [req("g0", temperature=0), req("s", temperature=1.0), req("g1", temperature=0), req("s2", top_k=3)]
    out = Sampler()(logits, reqs)
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0] and out.token_ids[2] == argmax[2]


def test_top_k_1_is_greedy():
    logits = random_logits(6, seed=1)
    for seed in range(5):
        out = Sampler(seed)(logits, [req(str(i), temperature=1.5, top_k=1) for i in range(6)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-6, 1e-320], ids=["1e-6", "zero-in-float32"])
def test_tiny_top_p_is_argmax(top_p):
    """The first token always stays, also where top_p rounds to 0 in float32 (1e-320: an API client's value)."""
    logits = random_logits(6, seed=2)
    for seed in range(5):
        out = Sampler(seed)(logits, [req(str(i), temperature=1.0, top_p=top_p) for i in range(6)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_only_draws_from_the_k_best():
    logits = torch.zeros(1, VOCAB)
    logits[0, :] = torch.arange(VOCAB, dtype=torch.float)  # token VOCAB-1 is best
    sampler = Sampler(3)
    seen = {sampler(logits, [req(temperature=5.0, top_k=3)]).token_ids[0] for _ in range(200)}
    assert seen == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler(4)
    seen = {sampler(logits, [req(temperature=1.0, top_p=0.75)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 reaches it
    seen = {sampler(logits, [req(temperature=1.0, top_p=0.81)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1, 2}


def test_min_p_drops_tokens_below_the_threshold():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampler = Sampler(5)
    seen = {sampler(probs.log(), [req(temperature=1.0, min_p=0.5)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.5
    seen = {sampler(probs.log(), [req(temperature=1.0, min_p=0.2)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1, 2}


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 4.0, -4.0, 1.0, 0.5]])
    r = req(prompt=[0], outputs=[1], repetition_penalty=2.0, temperature=0)
    out = apply_penalties(logits, [r])
    expected = torch.tensor([[1.0, -4.0, 4.0, -4.0, 1.0, 0.5]])
    torch.testing.assert_close(out, expected)
    assert out is logits  # in place: a step's logits are its own (the sampler copies them only for logprobs)


def test_frequency_and_presence_penalties_subtract():
    logits = torch.zeros(1, 6)
    # Prompt tokens do not count for frequency/presence, only generated ones.
    r = req(prompt=[5, 5], outputs=[1, 1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25, temperature=0)
    out = apply_penalties(logits, [r])
    expected = torch.tensor([[0.0, -1.5 - 0.25, -0.5 - 0.25, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert Sampler()(logits, [req(prompt=[2], outputs=[0], temperature=0)]).token_ids == [0]
    assert Sampler()(logits, [req(prompt=[2], outputs=[0], temperature=0, presence_penalty=0.5)]).token_ids == [1]
    assert Sampler()(logits, [req(prompt=[2], outputs=[0], temperature=0, repetition_penalty=1.1)]).token_ids == [1]
    # A token seen only in the prompt is penalised by repetition_penalty too.
    assert Sampler()(logits, [req(prompt=[0], temperature=0, repetition_penalty=1.1)]).token_ids == [1]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[10.0, 9.0, 1.0, 0.0]])  # EOS (0) then stop token 1 are best
    r = req(eos=frozenset({0}), temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[1])
    assert Sampler()(logits, [r]).token_ids == [2]
    r.append_output_token(2)
    r.append_output_token(3)
    assert Sampler()(logits, [r]).token_ids == [0]


def test_seeded_rows_do_not_depend_on_the_batch():
    # Unit-scale logits: the target row's distribution is spread (at the usual scale of 3 its top token has 0.99).
    logits = random_logits(4, seed=7) / 3
    target = logits[2:3]

    def alone():
        return [req("x", temperature=1.0, seed=42)]

    def crowded():
        return [req("a", temperature=0.7), req("b", temperature=0), req("x", temperature=1.0, seed=42),
                req("c", temperature=1.3, seed=9)]

    # The seeded request keeps its generator across calls, so build it once per sequence of draws.
    x1 = alone()
    s1 = Sampler(seed=1)
    seq_alone = [s1(target, x1).token_ids[0] for _ in range(30)]
    batch = crowded()
    s2 = Sampler(seed=999)
    seq_crowded = [s2(logits, batch).token_ids[2] for _ in range(30)]
    assert seq_alone == seq_crowded
    assert len(set(seq_alone)) > 1  # it really samples
    # Same seed again → same sequence; a different seed → a different one.
    x2 = alone()
    s3 = Sampler(seed=5)
    assert [s3(target, x2).token_ids[0] for _ in range(30)] == seq_alone
    other = [req("x", temperature=1.0, seed=43)]
    assert [s3(target, other).token_ids[0] for _ in range(30)] != seq_alone


def test_unseeded_sampling_follows_the_engine_seed():
    logits = random_logits(3, seed=8)
    reqs = [req(str(i), temperature=1.0) for i in range(3)]
    s1, s2 = Sampler(11), Sampler(11)
    assert [s1(logits, reqs).token_ids for _ in range(5)] == [s2(logits, reqs).token_ids for _ in range(5)]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpp"])
def test_temperature_one_matches_softmax(kernels):
    """The draw (inverse CDF: torch's cumsum, or the C++ kernel on the CPU) follows the distribution."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    probs = logits.softmax(-1)[0]
    sampler = Sampler(2024, kernels=CpuKernels.build() if kernels else None)
    n = 6000
    batch = [req(str(i), temperature=1.0) for i in range(n)]
    tokens = sampler(logits.expand(n, -1), batch).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=logits.shape[1]).float()
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (counts.tolist(), expected.tolist())  # 5 dof: p ≈ 1e-5 at 30


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    n = 4000
    sampler = Sampler(3)

    def share_of_best(t):
        toks = sampler(logits.expand(n, -1), [req(str(i), temperature=t) for i in range(n)]).token_ids
        return toks.count(0) / n

    cold, warm = share_of_best(0.3), share_of_best(3.0)
    assert cold > 0.9
    assert warm < 0.5
    assert cold == pytest.approx((logits[0] / 0.3).softmax(-1)[0].item(), abs=0.03)


def test_logprobs_chosen_and_sorted_top_n():
    logits = random_logits(3, seed=9)
    reqs = [req("a", temperature=0, logprobs=3), req("b", temperature=0), req("c", temperature=1.0, logprobs=0)]
    out = Sampler()(logits, reqs)
    assert out.logprobs[1] is None
    lsm = logits.log_softmax(-1)
    for row in (0, 2):
        chosen, rank, top_ids, top_vals = out.logprobs[row]
        tok = out.token_ids[row]
        assert chosen == pytest.approx(float(lsm[row, tok]), abs=1e-5)
        assert rank == int((lsm[row] > lsm[row, tok]).sum()) + 1
    chosen, rank, top_ids, top_vals = out.logprobs[0]
    assert rank == 1  # greedy picks the top token
    assert len(top_ids) == 3
    assert top_vals == sorted(top_vals, reverse=True)
    assert top_ids == lsm[0].argsort(descending=True)[:3].tolist()
    assert sum(math.exp(v) for v in lsm[0].tolist()) == pytest.approx(1.0, abs=1e-5)
    assert out.logprobs[2][2] == [] and out.logprobs[2][3] == []


def test_logprobs_are_of_the_raw_distribution_not_the_penalised_one():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    r = req(prompt=[2], outputs=[0], temperature=0, presence_penalty=1.0, logprobs=1)
    out = Sampler()(logits, [r])
    assert out.token_ids == [1]
    assert out.logprobs[0][0] == pytest.approx(float(logits.log_softmax(-1)[0, 1]), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_with_kernels_matches_the_general_path(dtype):
    """With the C++ kernels, plain greedy rows take an argmax on the model's own logits; anything that
    adjusts or reports (min_tokens, penalties, logprobs) still goes through the float32 path."""
    kernels = CpuKernels.build()
    assert kernels is not None
    logits = random_logits(4, seed=5, vocab=300).to(dtype)
    plain = [req(str(i), temperature=0) for i in range(4)]
    fast = Sampler(kernels=kernels)(logits, plain)
    assert fast.token_ids == Sampler()(logits, plain).token_ids == logits.float().argmax(-1).tolist()
    # min_tokens bans EOS (token 0 here) even where it is the argmax, on the kernel-equipped sampler too
    logits[1, 0] = 100.0
    mixed = [req("a", temperature=0), req("b", temperature=0, min_tokens=2), req("c", temperature=0, logprobs=2),
             req("d", temperature=0, repetition_penalty=1.5, outputs=(7,))]
    out = Sampler(kernels=kernels)(logits, mixed)
    assert out.token_ids == Sampler()(logits, mixed).token_ids
    assert out.token_ids[1] != 0 and out.logprobs[2] is not None


def test_inverse_cdf_kernel_equals_torch_and_never_draws_a_zero_weight():
    """The draw per row: the first index whose float64 running sum exceeds u times the total, the C++ kernel and
    torch's cumsum alike; a zero weight is never drawn, u = 0 draws the first positive weight, a row without a
    positive finite total gives -1 (the sampler then names the row in its error)."""
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 1000, generator=g)
    probs[probs < 0.7] = 0  # 70% of the weights are 0
    probs[5] = 0  # no positive weight
    probs[6, 17] = float("nan")  # a non-finite total
    probs[7] = 0
    probs[7, 999] = 1e-30  # one tiny weight, the last
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[8], u[9] = 0.0, 1 - 2**-53
    cpp = EngineSampler(kernels=CpuKernels.build())._inverse_cdf(probs, u)
    plain = EngineSampler()._inverse_cdf(probs, u)
    assert torch.equal(cpp, plain)
    assert cpp[5] == -1 and cpp[6] == -1 and cpp[7] == 999
    assert cpp[8] == int((probs[8] > 0).nonzero()[0])
    for r in [r for r in range(64) if r not in (5, 6)]:
        weights, acc, pick = probs[r].double().tolist(), 0.0, None
        t = float(u[r]) * sum(weights)
        for i, w in enumerate(weights):
            acc += w
            if acc > t:
                pick = i
                break
        if pick is None:  # rounding past the end: the last positive weight
            pick = max(i for i, w in enumerate(weights) if w > 0)
        assert int(cpp[r]) == pick and probs[r, pick] > 0, r
    with pytest.raises(ValueError, match="row 1 gave token id -1"):
        EngineSampler(kernels=CpuKernels.build())(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]),
                                                  SamplingMetadata.from_requests([req("a", temperature=1.0),
                                                                                  req("b", temperature=1.0)]))


def _filter_meta(temps, top_k, top_p, min_p) -> SamplingMetadata:
    return SamplingMetadata(num_rows=len(temps), all_greedy=False, all_plain_greedy=False,
                            greedy=torch.tensor([t == 0 for t in temps]),
                            temperature=torch.tensor([t or 1.0 for t in temps]).unsqueeze(1),
                            top_k=torch.tensor(top_k), top_p=torch.tensor(top_p, dtype=torch.float32),
                            min_p=torch.tensor(min_p, dtype=torch.float32), generators=[None] * len(temps))


@pytest.mark.parametrize("vocab,scale,ties", [(7, 3.0, False), (1000, 3.0, True), (5000, 1.0, False),
                                              (20000, 3.0, False), (20000, 3.0, True)])
def test_cpu_draw_kernel_equals_the_torch_path(vocab, scale, ties):
    """On the CPU one C++ kernel does temperature, top-k / top-p / min-p and the draw per row from the logits: the
    torch path's tokens (its stable sort, softmax, cumulative mass and inverse CDF) for the same uniforms, greedy rows
    included. Ties (logits rounded to halves, -0 beside +0) stay in index order; 20,000 tokens with top-k 3,000 sort
    the candidates in several chunks."""
    kernels = CpuKernels.build()
    rng = torch.Generator().manual_seed(vocab)
    pick = random.Random(vocab + int(ties))
    rows = 48
    logits = torch.randn(rows, vocab, generator=rng) * scale
    if ties:
        logits = (logits * 2).round() / 2
        zeros = logits == 0
        logits[zeros] = 0.0
        zeros[:, ::2] = False
        logits[zeros] = -0.0  # -0 at odd indices, +0 at even ones
    logits[0] = float("-inf")
    logits[0, vocab // 2] = 1.0  # one finite logit
    logits[1, : vocab // 2] = float("-inf")
    # Ties stay ties after the temperature only at T = 1 (the kernel ranks the raw logits, torch the scaled ones).
    temps = [pick.choice([0.0, 1.0] if ties else [0.0, 0.05, 0.7, 1.0, 2.5]) for _ in range(rows)]
    top_k = [pick.choice([0, 0, 1, 5, 50, 3000, vocab, vocab + 3]) for _ in range(rows)]
    top_p = [pick.choice([1.0, 1.0, 0.5, 0.9, 0.99, 1e-6]) for _ in range(rows)]
    min_p = [pick.choice([0.0, 0.0, 0.01, 0.2]) for _ in range(rows)]
    meta = _filter_meta(temps, top_k, top_p, min_p)
    for seed in range(3):
        fused = EngineSampler(seed, kernels=kernels)(logits.clone(), meta).token_ids
        assert fused == EngineSampler(seed)(logits.clone(), meta).token_ids
        assert all(logits[r, t] > float("-inf") for r, t in enumerate(fused))
        for r, t in enumerate(fused):
            if temps[r] == 0 or top_k[r] == 1 or top_p[r] == 1e-6:
                assert t == int(logits[r].argmax()), r


def test_cpu_draw_kernel_follows_the_filtered_distribution():
    """The kernel's draws over a large vocabulary with the filters on follow the renormalised kept distribution
    (chi-square), and never leave the kept set: top-k 40, then top-p 0.8 of their mass, then min-p 0.02."""
    kernels = CpuKernels.build()
    vocab = 50_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 0.5
    logits[0, :60] += torch.linspace(4.0, 1.0, 60)  # 60 leading tokens, then a flat tail
    order = logits[0].argsort(descending=True, stable=True)
    probs = logits[0].softmax(-1)[order]
    top = probs[:40] / probs[:40].sum()
    kept = int(((top.cumsum(0) - top) < 0.8).sum())
    keep = top[:kept]
    keep = keep[keep >= 0.02 * keep[0]]
    expected_ids = order[: len(keep)]
    n = 20000
    meta = _filter_meta([1.0] * n, [40] * n, [0.8] * n, [0.02] * n)
    tokens = torch.tensor(EngineSampler(7, kernels=kernels)(logits.expand(n, -1), meta).token_ids)
    assert set(tokens.tolist()) <= set(expected_ids.tolist())
    counts = torch.tensor([(tokens == t).sum() for t in expected_ids.tolist()], dtype=torch.float)
    expected = keep / keep.sum() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert len(keep) >= 5 and chi2 < 3.0 * len(keep) + 30, (chi2, len(keep))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpp"])
@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (0, 0.5)])
def test_tied_logits_are_kept_in_index_order(kernels, top_k, top_p):
    """At a top-k / top-p cut among equal logits the lower indices stay (-0 and +0 are equal): both paths."""
    logits = torch.tensor([[-0.0, 0.0, 1.0, -0.0, 0.0]]).expand(300, -1)
    meta = _filter_meta([1.0] * 300, [top_k] * 300, [top_p] * 300, [0.0] * 300)
    tokens = EngineSampler(3, kernels=CpuKernels.build() if kernels else None)(logits, meta).token_ids
    assert set(tokens) == {0, 2}


@pytest.mark.parametrize("vocab", [5, 3000, 262144])
def test_logprobs_kernel_equals_the_torch_path(vocab):
    """On the CPU the logprobs come from a C++ kernel per row (log-sum-exp, rank, the top k by one pass): torch's
    log-softmax values, ranks and top ids, for the rows that asked (top-n from 0 to 20, one row twice the vocabulary's
    tokens when it is small); tied logits list in index order."""
    kernels = CpuKernels.build()
    rows = 12
    raw = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    raw[3, : min(vocab, 6)] = raw[3].max() + 1  # ties at the top
    tokens = [int(t) for t in torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))]
    nums = [None, 0, 1, 5, None, 20, 2, 3, 20, 0, 7, None]
    nums = [None if n is None else min(n, vocab) for n in nums]
    fast = EngineSampler(kernels=kernels).logprobs(raw, tokens, nums)
    ref = EngineSampler().logprobs(raw, tokens, nums)
    exact = torch.log_softmax(raw.double(), -1)
    # torch's float32 log-softmax itself drifts from float64 by up to ~3e-5 at 262,144 entries (its float32 sums
    # lose the smallest terms): the two paths agree within 1e-4, and the kernel's (a float64 sum) is within 1e-5.
    tol = 2e-5 if vocab < 100_000 else 1e-4
    for r in range(rows):
        if nums[r] is None:
            assert fast[r] is None and ref[r] is None
            continue
        (c1, k1, ids1, v1), (c2, k2, ids2, v2) = fast[r], ref[r]
        assert c1 == pytest.approx(c2, abs=tol) and k1 == k2
        assert c1 == pytest.approx(float(exact[r, tokens[r]]), abs=1e-5)
        assert len(ids1) == nums[r] and v1 == pytest.approx(v2, abs=tol)
        assert v1 == pytest.approx(exact[r, ids1].tolist(), abs=1e-5)
        if r == 3:
            assert ids1 == list(range(nums[3]))  # the six tied best, in index order (torch's topk: any of them)
        else:
            assert ids1 == ids2


def test_penalties_touch_only_seen_tokens_as_the_dense_formula():
    """The penalties, applied in place to the ids each row has seen, equal the dense formula over the vocabulary
    (counts by bincount, repetition where seen, then frequency × count and presence) bit for bit."""
    vocab, rows = 5000, 6
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(rows, vocab, generator=g) * 3
    reqs = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (40,), generator=g).tolist()
        outputs = torch.randint(0, 60, (30,), generator=g).tolist()  # repeats
        reqs.append(req(str(i), prompt=prompt, outputs=outputs, repetition_penalty=[1.0, 1.3][i % 2],
                        frequency_penalty=[0.0, 0.4, -0.7][i % 3], presence_penalty=[0.5, 0.0][i % 2],
                        temperature=1.0))
    expected = logits.clone()
    for i, r in enumerate(reqs):
        p = r.sampling_params
        counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=vocab).float()
        row = expected[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(r.prompt_token_ids)] = True
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
        expected[i] = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    assert torch.equal(apply_penalties(logits, reqs), expected)


def test_probs_from_the_kernel_are_the_torch_paths():
    """The distributions speculative decoding verifies against (Sampler.probs): the C++ kernel's normalised weights,
    those its draw uses, equal the torch path's softmax after the filters; a greedy-temperature row in the kernel's
    own call is one-hot, a NaN row stays NaN."""
    kernels = CpuKernels.build()
    logits = torch.randn(6, 4000, generator=torch.Generator().manual_seed(2)) * 3
    meta = _filter_meta([1.0, 0.7, 1.3, 1.0, 0.5, 2.0], [0, 40, 0, 3, 0, 100], [1.0, 0.9, 0.8, 1.0, 0.95, 1.0],
                        [0.0, 0.0, 0.05, 0.0, 0.0, 0.01])
    torch.testing.assert_close(EngineSampler(kernels=kernels).probs(logits, meta), EngineSampler().probs(logits, meta),
                               atol=1e-6, rtol=1e-4)
    logits[1, 7] = float("nan")
    w = kernels.filtered_weights(logits, torch.tensor([0.0, 1, 1, 1, 1, 1]), meta.top_k, meta.top_p, meta.min_p)
    assert w[0].sum() == 1 and w[0, int(logits[0].argmax())] == 1 and w[1].isnan().all()
    logits[0, 5] = float("nan")  # a greedy row with a NaN cannot draw either: NaN, not one-hot at an index
    w = kernels.filtered_weights(logits, torch.tensor([0.0, 1, 1, 1, 1, 1]), meta.top_k, meta.top_p, meta.min_p)
    assert w[0].isnan().all() and w[2].sum() > 0


@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("how", ["plain", "penalized", "mixed"])
def test_greedy_rows_with_a_nan_logit_are_refused_not_turned_into_tokens(with_kernels, how):
    """Every greedy path names a row whose logits hold a NaN (in_vocab's error) instead of emitting a token: the plain
    greedy argmax, greedy after the penalties, greedy rows beside sampled ones; with the C++ kernels and on the torch
    path (whose argmax alone would return the NaN's index). The same logits without the NaN give torch's argmax."""
    sampler = EngineSampler(kernels=CpuKernels.build() if with_kernels else None)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(5))
    logits[1, 250] = 50.0
    extra = {"presence_penalty": 0.5} if how == "penalized" else {}
    reqs = [req("a", outputs=(3, 4), temperature=0.0, **extra), req("b", outputs=(3, 4), temperature=0.0, **extra),
            req("c", outputs=(3, 4), temperature=1.0 if how == "mixed" else 0.0, **extra)]
    meta = SamplingMetadata.from_requests(reqs)
    clean = sampler(logits.clone(), meta).token_ids
    assert clean[:2] == logits[:2].argmax(-1).tolist() or how == "penalized"
    logits[1, 100] = float("nan")
    with pytest.raises(ValueError, match="row 1 gave token id -1"):
        sampler(logits, meta)
