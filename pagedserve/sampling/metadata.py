"""SamplingMetadata: what the sampler needs for one step, built once per step from the sampling requests.

The sampler sees rows, tensors and token-id lists, never a Request: the per-row parameters are stacked
into tensors here (only those some row uses), and the per-request random generators (seeded requests)
are handed in by their owner, the engine (`RequestGenerators`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.core.request import Request
    from pagedserve.structured_output.manager import TokenMask


@dataclass(slots=True)
class Penalty:
    row: int
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    repetition: float
    frequency: float
    presence: float


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    # Greedy with nothing to adjust or report: argmax straight on the model's logits (no upcast).
    all_plain_greedy: bool
    greedy: torch.Tensor | None  # [rows] bool; None when all_greedy
    temperature: torch.Tensor | None  # [rows, 1] float32 (1.0 on greedy rows); None when all_greedy
    top_k: torch.Tensor | None  # [rows] int64 (0: off); None when no row filters
    top_p: torch.Tensor | None  # [rows] float32
    min_p: torch.Tensor | None  # [rows] float32; None when no row uses it
    generators: list[torch.Generator | None]  # per row: the request's own (seeded) generator
    penalties: list[Penalty] = field(default_factory=list)
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, token ids): min_tokens
    num_logprobs: list[int | None] = field(default_factory=list)  # per row: top-N asked for, or None
    # Structured outputs: the allowed tokens of the constrained rows, being filled while the model runs.
    token_mask: TokenMask | None = None

    @classmethod
    def from_requests(cls, requests: Sequence[Request], generators: Sequence[torch.Generator | None] | None = None,
                      vocab_size: int | None = None, token_mask: TokenMask | None = None,
                      device: torch.device | str = "cpu") -> SamplingMetadata:
        """vocab_size: the logits' width; banned ids beyond it (the tokenizer may know more) are dropped;
        device: the logits' (the per-row tensors are made there)."""
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        penalties = [
            Penalty(i, r.output_token_ids, r.prompt_token_ids, p.repetition_penalty, p.frequency_penalty,
                    p.presence_penalty)
            for i, (r, p) in enumerate(zip(requests, params, strict=True)) if has_penalty(p)
        ]
        banned = []
        for i, (r, p) in enumerate(zip(requests, params, strict=True)):
            if r.num_output_tokens < p.min_tokens:  # before min_tokens, EOS and stop ids cannot be drawn
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else r.eos_token_ids)
                if vocab_size is not None:
                    ids = {t for t in ids if t < vocab_size}
                if ids:
                    banned.append((i, sorted(ids)))
        num_logprobs = [p.logprobs for p in params]
        sampled = [p for p in params if not p.greedy]
        filters = any(p.top_k > 0 or p.top_p < 1.0 for p in sampled)
        return cls(
            num_rows=len(params),
            all_greedy=all(greedy),
            all_plain_greedy=all(greedy) and not penalties and not banned
            and all(n is None for n in num_logprobs)
            and all(r.num_output_tokens >= p.min_tokens for r, p in zip(requests, params, strict=True)),
            # Only a step that draws reads these: an all-greedy step (most) builds no tensor at all.
            greedy=None if all(greedy) else torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=None if all(greedy) else torch.tensor(
                [1.0 if p.greedy else p.temperature for p in params], device=device).unsqueeze(1),
            top_k=torch.tensor([p.top_k for p in params], device=device) if filters else None,
            top_p=torch.tensor([p.top_p for p in params], device=device) if filters else None,
            min_p=torch.tensor([p.min_p for p in params], device=device) if any(p.min_p > 0 for p in sampled)
            else None,
            generators=list(generators) if generators is not None else [None] * len(params),
            penalties=penalties,
            banned=banned,
            num_logprobs=num_logprobs,
            token_mask=token_mask,
        )


def has_penalty(p) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class RequestGenerators:
    """The random generator of each seeded request, made when it is added and kept until it finishes
    (preemption keeps it: a recomputed request draws on from where it was). The generators live on the
    sampler's device (a CUDA generator on the GPU: same seed, same tokens, run after run)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._by_id: dict[str, torch.Generator] = {}
        self.device = torch.device(device)

    def add(self, request_id: str, seed: int | None) -> None:
        if seed is not None:
            self._by_id[request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def for_requests(self, requests: Sequence[Request]) -> list[torch.Generator | None]:
        return [self._by_id.get(r.request_id) for r in requests]

    def states(self, request_ids) -> dict[str, torch.Tensor]:
        """The current state of these requests' generators (those that have one), to roll a failed step back."""
        return {rid: g.get_state() for rid in request_ids if (g := self._by_id.get(rid)) is not None}

    def restore(self, states: dict[str, torch.Tensor]) -> None:
        for rid, state in states.items():
            if (g := self._by_id.get(rid)) is not None:
                g.set_state(state)

    def drop(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_id)
