"""The sampler, batched over every request that samples this step.

Order (as vLLM): penalties → temperature → top-k / top-p / min-p → draw. Greedy rows take the argmax.
Random rows draw with the exponential-race trick (argmax p / E, E ~ Exp(1)), which is exactly a
categorical draw; a request with a seed draws its E from its own generator, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.core.request import Request


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row, when asked for: (chosen token logprob, chosen token rank, top ids, top logprobs).
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


class Sampler:
    def __init__(self, seed: int = 0, kernels=None) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.kernels = kernels  # pagedserve's C++ CPU kernels (argmax_rows), or None

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [len(requests), vocab] in the model's dtype (bf16 logits are upcast only if needed)."""
        if self.kernels is not None and logits.device.type == "cpu" and all(map(_plain_greedy, requests)):
            # Greedy with nothing to adjust or report: argmax straight on the model's logits.
            return SamplerOutput(self.kernels.argmax_rows(logits).tolist(), [None] * len(requests))
        logits = logits.float()
        raw = logits
        params = [r.sampling_params for r in requests]
        logits = self._apply_min_tokens(logits, requests)
        logits = self._apply_penalties(logits, requests)
        greedy = torch.tensor([p.greedy for p in params])
        if bool(greedy.all()):
            tokens = logits.argmax(dim=-1)
        else:
            temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params]).unsqueeze(1)
            probs = self._filter(logits / temps, params).softmax(dim=-1)
            drawn = self._draw(probs, requests)
            tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, token_list, params))

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Before min_tokens are out, EOS and stop token ids cannot be drawn at all."""
        rows = [i for i, r in enumerate(requests) if r.num_output_tokens < r.sampling_params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            r = requests[i]
            banned = set(r.sampling_params.stop_token_ids)
            if not r.sampling_params.ignore_eos:
                banned |= r.eos_token_ids
            if banned:
                logits[i, sorted(banned)] = float("-inf")
        return logits

    # ---- penalties -------------------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if _has_penalty(r)]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:  # only requests that asked for penalties pay for this
            p = requests[i].sampling_params
            out_ids = torch.tensor(requests[i].output_token_ids, dtype=torch.long)
            counts = torch.bincount(out_ids, minlength=vocab)[:vocab].float()
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[torch.tensor(requests[i].prompt_token_ids, dtype=torch.long)] = True
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = torch.where(seen, penalised, row)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            logits[i] = row
        return logits

    # ---- top-k / top-p / min-p -------------------------------------------------------------------
    @staticmethod
    def _filter(logits: torch.Tensor, params) -> torch.Tensor:
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[1]
            keep = torch.ones_like(sorted_logits, dtype=torch.bool)
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
            keep &= torch.arange(vocab).unsqueeze(0) < k.unsqueeze(1)
            probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = probs.cumsum(dim=-1) - probs
            keep &= mass_before < top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if bool((min_p > 0).any()):
            probs = logits.softmax(dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    # ---- the draw --------------------------------------------------------------------------------
    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        return (probs / q).argmax(dim=-1)

    # ---- logprobs --------------------------------------------------------------------------------
    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], params):
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list = [None] * len(params)
        if not rows:
            return result
        lp = raw[rows].log_softmax(dim=-1)
        k = max(params[i].logprobs for i in rows)
        top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(rows):
            chosen = lp[j, tokens[i]]
            rank = int((lp[j] > chosen).sum()) + 1
            n = params[i].logprobs
            result[i] = (float(chosen), rank, top_ids[j, :n].tolist(), top_vals[j, :n].tolist())
        return result


def _plain_greedy(r: Request) -> bool:
    p = r.sampling_params
    return p.greedy and p.logprobs is None and r.num_output_tokens >= p.min_tokens and not _has_penalty(r)


def _has_penalty(r: Request) -> bool:
    p = r.sampling_params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
