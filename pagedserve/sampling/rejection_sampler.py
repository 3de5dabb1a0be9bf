"""Verification of draft tokens (speculative decoding): what the target model keeps of each proposal.

The target scored k + 1 positions of a request with k drafts d1..dk in one step: row j holds its
distribution p_j for the token after d1..dj. Rows are grouped request by request; a request without drafts
has one row and is sampled exactly as the plain sampler would.

- Greedy: keep the longest prefix of drafts equal to the target's argmax, then the target's own argmax
  at the first mismatch (or after the last draft, the "bonus" token). The output is that of plain greedy
  decoding.
- Sampling: the proposals here are deterministic (n-gram lookup, a draft model's argmax), so draft dj is
  accepted with probability p_(j-1)(dj); on rejection the token is drawn from p_(j-1) with dj removed
  (the normalised max(0, p - q) of Leviathan et al. for a one-hot q); after k acceptances a bonus token is
  drawn from p_k. Each emitted token then has exactly the target's distribution, with its temperature and
  top-k / top-p / min-p. A seeded request draws its uniforms and its final token from its own generator,
  so its output is reproducible, and with no drafts it consumes the generator as plain sampling does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.sampler import Sampler, in_vocab


@dataclass(slots=True)
class VerifyOutput:
    token_ids: list[list[int]]  # per request: its accepted drafts, then one token of the target's
    logprobs: list[list]  # per request, per token: as SamplerOutput.logprobs (None where not asked)


def verify(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]]) -> VerifyOutput:
    """logits: [sum(len(d) + 1), vocab] float32, each request's rows in order; meta: one row per logits row
    (a request's rows repeat its parameters and its generator)."""
    vocab = logits.shape[1]
    if sampler.kernels is not None and logits.device.type == "cpu" and meta.all_plain_greedy:
        sampler._apply_token_mask(logits, meta)
        raw, adjusted = logits, logits
        argmax = in_vocab(sampler.greedy(logits).tolist(), vocab)
    else:
        raw, adjusted = sampler.adjust(logits, meta)
        argmax = sampler.greedy(adjusted).tolist()
    probs = None if meta.all_greedy else sampler.probs(adjusted, meta)
    tokens: list[list[int]] = []
    rows: list[int] = []  # the logits row each emitted token came from
    row = 0
    for d in drafts:
        k = len(d)
        if meta.all_greedy or bool(meta.greedy[row]):
            out = _verify_greedy(argmax, row, d)
        else:
            out = _verify_random(sampler, probs[row : row + k + 1], d, meta.generators[row])
        tokens.append(out)
        rows.extend(range(row, row + len(out)))
        row += k + 1
    flat = in_vocab([t for out in tokens for t in out], vocab)
    wanted = meta.num_logprobs or [None] * meta.num_rows
    if all(wanted[r] is None for r in rows):
        lps = [None] * len(rows)
    else:
        lps = sampler.logprobs(raw[rows], flat, [wanted[r] for r in rows])
    logprobs, at = [], 0
    for out in tokens:
        logprobs.append(lps[at : at + len(out)])
        at += len(out)
    return VerifyOutput(tokens, logprobs)


def _verify_greedy(argmax: list[int], row: int, drafts: list[int]) -> list[int]:
    out = []
    for j, d in enumerate(drafts):
        t = argmax[row + j]
        out.append(t)
        if t != d:
            return out
    out.append(argmax[row + len(drafts)])
    return out


def _verify_random(sampler: Sampler, probs: torch.Tensor, drafts: list[int], generator) -> list[int]:
    """probs: [k + 1, vocab], the target's distributions after temperature and filtering."""
    gen = generator or sampler.generator
    out = []
    if drafts:
        uniforms = torch.rand(len(drafts), generator=gen, device=gen.device).tolist()
        # The rows' own normalisation (a row can sum to 1 only up to rounding).
        rows = torch.arange(len(drafts), device=probs.device)
        p_draft = (probs[rows, torch.tensor(drafts, device=probs.device)] / probs[: len(drafts)].sum(-1)).tolist()
        for j, d in enumerate(drafts):
            if uniforms[j] < p_draft[j]:
                out.append(d)
                continue
            residual = probs[j].clone()
            residual[d] = 0.0  # max(0, p - onehot(d)), unnormalised: the draw below does not need it
            if not residual.sum() > 0:  # p(d) was 1 up to rounding: nothing else could be drawn
                out.append(d)
                continue
            out.append(sampler.draw_one(residual, gen))
            return out
    out.append(sampler.draw_one(probs[len(drafts)], gen))
    return out
