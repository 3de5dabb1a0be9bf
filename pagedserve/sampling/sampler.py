"""The sampler, batched over every request that samples this step.

Order (as vLLM): structured-output mask → penalties → temperature → top-k / top-p / min-p → draw.
Greedy rows take the argmax. Random rows draw by the inverse CDF: one float64 uniform per row, the first
token whose running sum of weights exceeds it times the total; a request with a seed draws its uniform
from its own generator, so its tokens do not depend on what else is in the batch.

The filters: top-k keeps the first k tokens in (logit descending, index ascending) order; top-p the
smallest prefix of those whose share of their mass reaches top_p (the first token always stays); min-p
the tokens whose probability is at least min_p times the largest. On the CPU one C++ kernel does
temperature, the filters and the draw per row from the logits (no [rows, vocab] tensor, no sort of the
vocabulary); elsewhere (a GPU) torch ops do the same.

In the strict batch-invariant mode every reduction over the vocabulary (softmax, log-softmax, the
top-p cumulative sum) runs row by row, so a row's numbers cannot depend on how many rows there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import CpuKernels
from pagedserve.sampling.metadata import Penalty, SamplingMetadata
from pagedserve.structured_output.manager import apply_token_mask


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row, when asked for: (chosen token logprob, chosen token rank, top ids, top logprobs).
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


@dataclass
class StepsOutput:
    """A multi-step schedule's tokens (ModelRunner.execute): per row, one greedy token per step run."""

    token_ids: list[list[int]]
    logprobs: list[list[None]]  # (none asked for: multi-step runs only plain greedy rows)


class Sampler:
    def __init__(self, seed: int = 0, kernels: CpuKernels | None = None, batch_invariant: bool = False,
                 device: torch.device | str = "cpu") -> None:
        # On a GPU every step's draws stay there: the engine's generator and the seeded requests' own.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.kernels = kernels  # pagedserve's C++ CPU kernels (argmax_rows), or None
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [meta.num_rows, vocab], float32 (the model's head returns float32 in every dtype). The
        logprobs are those of the model's logits, before any mask or penalty (vLLM's raw logprobs)."""
        if self._kernels_for(logits) and meta.all_plain_greedy:
            # Greedy with nothing to adjust or report: argmax straight on the model's (masked) logits.
            self._apply_token_mask(logits, meta)
            return SamplerOutput(in_vocab(self.greedy(logits).tolist(), logits.shape[1]), [None] * meta.num_rows)
        raw, logits = self.adjust(logits, meta)
        if meta.all_greedy:
            tokens = self.greedy(logits)
        elif self._kernels_for(logits):
            tokens = self._sample_cpu(logits, meta)
        else:
            drawn = self._draw(self.probs(logits, meta), meta.generators)
            tokens = torch.where(meta.greedy, self.greedy(logits), drawn)
        token_list = in_vocab(tokens.tolist(), logits.shape[1])
        return SamplerOutput(token_list, self.logprobs(raw, token_list, meta.num_logprobs))

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: each row's first argmax, -1 where one of its logits is NaN (in_vocab then names the row, and
        the engine fails only its request; torch.argmax alone would return the NaN's index as a token). The C++
        kernel on the CPU (float32 or bf16 rows), torch elsewhere."""
        if self._kernels_for(logits):
            return self.kernels.argmax_rows(_rows_contiguous(logits))
        return logits.argmax(dim=-1).masked_fill_(logits.isnan().any(dim=-1), -1)

    def from_argmax(self, ids: torch.Tensor, vocab: int) -> SamplerOutput:
        """An all-plain-greedy step whose model handed over each row's argmax (int64 [rows], -1 for a row with a NaN
        logit) instead of its logits: those tokens, as __call__'s greedy path would pick them."""
        return SamplerOutput(in_vocab(ids.tolist(), vocab), [None] * ids.shape[0])

    def adjust(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the raw float32 logits, the logits after the grammar mask, min_tokens and the penalties)."""
        logits = logits.float()
        raw = logits
        if meta.token_mask is not None or meta.banned or meta.penalties:
            # In place on the model's logits (each step's are its own; a failed step recomputes them), on a copy
            # only where logprobs read the unadjusted ones.
            if any(n is not None for n in meta.num_logprobs):
                logits = logits.clone()
            self._apply_token_mask(logits, meta)
        logits = self._apply_min_tokens(logits, meta.banned)
        return raw, self._apply_penalties(logits, meta.penalties)

    def probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each row draws from: temperature, then top-k / top-p / min-p (on the CPU the C++ kernel's
        weights, those `sample_logits` draws from, normalised)."""
        if self._kernels_for(logits):
            temperature, top_k, top_p, min_p = self._filter_args(meta)
            w = self.kernels.filtered_weights(_rows_contiguous(logits.float()), temperature, top_k, top_p, min_p)
            return w / self._rows(lambda r: r.sum(dim=-1, keepdim=True), w)
        return self._softmax(self._filter(logits / meta.temperature, meta))

    def _kernels_for(self, x: torch.Tensor) -> bool:
        """Whether the C++ kernels take this tensor's work (built, and x on the CPU)."""
        return self.kernels is not None and x.device.type == "cpu"

    @staticmethod
    def _filter_args(meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The C++ kernels' per-row temperature (as in meta: 1 on greedy rows), top_k (0: off), top_p, min_p."""
        rows = meta.num_rows
        temperature = meta.temperature.squeeze(1).float().contiguous()
        top_k = meta.top_k.contiguous() if meta.top_k is not None else torch.zeros(rows, dtype=torch.long)
        top_p = meta.top_p.float().contiguous() if meta.top_p is not None else torch.ones(rows)
        min_p = meta.min_p.float().contiguous() if meta.min_p is not None else torch.zeros(rows)
        return temperature, top_k, top_p, min_p

    def _apply_token_mask(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        """Structured outputs: the tokens a constrained row's grammar does not allow get -inf (in place)."""
        if meta.token_mask is None:
            return
        rows, bitmask = meta.token_mask.result()  # waits for the fill that ran beside the forward pass
        apply_token_mask(logits, rows, bitmask, self.kernels)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, banned: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Before min_tokens are out, EOS and stop token ids cannot be drawn at all (in place)."""
        for row, ids in banned:
            logits[row, ids] = float("-inf")
        return logits

    # ---- penalties -------------------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, penalties: list[Penalty]) -> torch.Tensor:
        """In place, on the tokens each penalised row has seen only (its prompt's and output's ids, not the whole
        vocabulary): repetition divides a positive logit / multiplies a negative one, then frequency × count and
        presence are subtracted for the output's ids."""
        vocab = logits.shape[1]
        for p in penalties:  # only requests that asked for penalties pay for this
            out_ids = torch.tensor(p.output_token_ids, dtype=torch.long, device=logits.device)
            out_ids = out_ids[out_ids < vocab]
            row = logits[p.row]
            if p.repetition != 1.0:
                prompt_ids = torch.tensor(p.prompt_token_ids, dtype=torch.long, device=logits.device)
                seen = torch.unique(torch.cat([out_ids, prompt_ids]))
                v = row[seen]
                row[seen] = torch.where(v > 0, v / p.repetition, v * p.repetition)
            if p.frequency != 0.0 or p.presence != 0.0:
                ids, counts = torch.unique(out_ids, return_counts=True)
                row[ids] = row[ids] - p.frequency * counts.float() - p.presence
        return logits

    # ---- top-k / top-p / min-p -------------------------------------------------------------------
    def _filter(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        top_k, top_p, min_p = meta.top_k, meta.top_p, meta.min_p
        if top_k is not None and top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # ties: index order
            vocab = logits.shape[1]
            keep = torch.ones_like(sorted_logits, dtype=torch.bool)
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
            keep &= torch.arange(vocab, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
            probs = self._softmax(sorted_logits.masked_fill(~keep, float("-inf")))
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = self._rows(lambda r: r.cumsum(dim=-1), probs) - probs
            keep &= mass_before < top_p.unsqueeze(1)
            keep[:, 0] = True  # (a top_p that is 0 in float32, 1e-320, would otherwise keep nothing)
            sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if min_p is not None:
            probs = self._softmax(logits)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    # ---- reductions over the vocabulary ----------------------------------------------------------
    def _rows(self, fn, x: torch.Tensor) -> torch.Tensor:
        """fn over the last dim of a [R, V] tensor: batched, or in the strict mode one row at a time (a
        row's reduction order then cannot depend on R)."""
        if not self.batch_invariant or x.shape[0] <= 1:
            return fn(x)
        return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])

    def _softmax(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(lambda r: r.softmax(dim=-1), x)

    # ---- the draw --------------------------------------------------------------------------------
    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One float64 uniform per row, from the row's own generator where the request is seeded, else from the
        engine's (one call for the batch; greedy rows take theirs too, so a row's draws do not depend on the others)."""
        u = torch.rand(len(generators), generator=self.generator, dtype=torch.float64, device=self.generator.device)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device)[0]
        return u

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of (unnormalised) probabilities, by the inverse CDF."""
        return self._inverse_cdf(probs, self._uniforms(generators))

    def _sample_cpu(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k / top-p / min-p and the draw in one C++ kernel per row (the torch path's tokens, without
        its [rows, vocab] temporaries or its sort of the whole vocabulary)."""
        temperature, top_k, top_p, min_p = self._filter_args(meta)
        temperature = temperature.masked_fill(meta.greedy, 0.0)  # greedy rows: the argmax, in the same call
        return self.kernels.sample_logits(_rows_contiguous(logits.float()), temperature, top_k, top_p, min_p,
                                          self._uniforms(meta.generators))

    def draw_one(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One categorical draw from a [vocab] row of (unnormalised) probabilities, consuming the generator
        exactly as `_draw` does for that row (a seeded request draws the same token either way)."""
        gen = generator or self.generator
        u = torch.rand(1, generator=gen, dtype=torch.float64, device=gen.device)
        return int(self._inverse_cdf(probs.unsqueeze(0), u)[0])

    def _inverse_cdf(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Per row, the first index whose running sum (float64, in index order) exceeds u times the row's total: a
        weight of 0 is never drawn; rounding past the end draws the last positive weight; a row without a positive
        finite total gives -1 (`in_vocab` names it). The C++ kernel on the CPU (the exponential race it replaces
        drew one random number per vocabulary entry: 0.7 s per step for 128 rows of a 262,144-token vocabulary),
        torch's cumsum elsewhere: the same indices."""
        probs = probs.float()
        if self._kernels_for(probs):
            return self.kernels.sample_rows(_rows_contiguous(probs), u)
        c = probs.double().cumsum(dim=-1)
        total = c[:, -1]
        pick = torch.searchsorted(c, (u.to(c) * total).unsqueeze(1), right=True).squeeze(1)
        positive = probs > 0
        last = probs.shape[1] - 1 - positive.flip(-1).to(torch.uint8).argmax(dim=-1)
        pick = torch.where(pick < probs.shape[1], pick, last)
        ok = positive.any(dim=-1) & torch.isfinite(total)
        return torch.where(ok, pick, torch.full_like(pick, -1))

    # ---- logprobs --------------------------------------------------------------------------------
    def logprobs(self, raw: torch.Tensor, tokens: list[int], num_logprobs: list[int | None]):
        rows = [i for i, n in enumerate(num_logprobs) if n is not None]
        result: list = [None] * len(num_logprobs)
        if not rows:
            return result
        k = max(num_logprobs[i] for i in rows)
        if self._kernels_for(raw):  # per row in C++: no [rows, vocab] log-softmax
            chosen, rank, top_ids, top_vals = (t.tolist() for t in self.kernels.logprobs_rows(
                _rows_contiguous(raw.float()), torch.tensor(rows), torch.tensor([tokens[i] for i in rows]),
                min(max(k, 1), raw.shape[1])))
            for j, i in enumerate(rows):
                n = num_logprobs[i]
                result[i] = (chosen[j], rank[j], top_ids[j][:n], top_vals[j][:n])
            return result
        lp = self._rows(lambda r: r.log_softmax(dim=-1), raw[rows])
        top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(rows):
            chosen = lp[j, tokens[i]]
            rank = int((lp[j] > chosen).sum()) + 1
            n = num_logprobs[i]
            result[i] = (float(chosen), rank, top_ids[j, :n].tolist(), top_vals[j, :n].tolist())
        return result


def in_vocab(tokens: list[int], vocab: int) -> list[int]:
    """The sampled ids, or an error naming the row: an id outside the vocabulary (from non-finite logits)
    must never reach a request (the engine then fails only the request(s) responsible)."""
    for row, t in enumerate(tokens):
        if not 0 <= t < vocab:
            raise ValueError(f"sampler: row {row} gave token id {t}, outside [0, {vocab}) (non-finite logits?)")
    return tokens


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with contiguous rows, as the C++ kernels read them (any row stride: a sliced or broadcast batch is not
    copied)."""
    return x if x.stride(-1) == 1 else x.contiguous()
