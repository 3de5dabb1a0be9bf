"""StructuredOutputManager: the engine's side of structured outputs.

- **Compiling off the engine thread.** `submit(params)` hands the compile to a worker thread and returns
  a future; the engine keeps the request out of the scheduler until it resolves, so a slow grammar never
  holds up the batch. The OpenAI server compiles in its own thread before it adds the request (an invalid
  spec is a 400 there), so the engine then finds it in the cache.
- **One matcher per sequence** (n > 1: one per sample), advanced with every sampled token (`accept`).
  Preemption keeps a request's tokens (recompute), so its matcher stays where it was.
- **Masks per step**: `start_masks(request_ids)` starts filling one bitmask row per constrained row in a
  thread (llguidance's executor, which drops the GIL) while the model runs its forward pass; the sampler
  waits for it (`TokenMask.result()`) and sets the disallowed logits to -inf before sampling.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from pagedserve.structured_output.backend import GuidanceBackend
from pagedserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.tokenizer import Tokenizer


@dataclass
class TokenMask:
    """The bitmask rows of one step: `rows` (int64, rows of the step's logits) and `bitmask` (int32
    [len(rows), words]), filled by a future; `seconds`: the time the fill took (on its thread)."""

    rows: torch.Tensor
    bitmask: torch.Tensor
    future: Future | None = None
    seconds: float = 0.0
    wait_seconds: float = 0.0  # how long the sampler waited for it (what the forward pass did not hide)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.future is not None:
            t0 = time.perf_counter()
            self.seconds = self.future.result()
            self.wait_seconds = time.perf_counter() - t0
            self.future = None
        return self.rows, self.bitmask


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int],
                 mask_threads: int | None = None) -> None:
        self.backend = GuidanceBackend(tokenizer, vocab_size, eos_token_ids)
        self.mask_threads = mask_threads
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        self._mask_pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    # ---- compiling -----------------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> None:
        """Compile into the cache now, on the caller's thread (ValueError naming the problem)."""
        self.backend.template(params)

    def prepare(self, params: StructuredOutputsParams) -> Future:
        """A future that resolves once `params` is compiled into the cache, on the compile thread (the
        server's check before it adds a request; the engine's `submit` then finds it cached)."""
        if self.backend.is_cached(params):
            fut: Future = Future()
            fut.set_result(None)
            return fut
        return self._compile_pool.submit(self.backend.template, params)

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of a fresh matcher. Cached specs resolve at once, on the caller's thread."""
        if self.backend.is_cached(params):
            fut: Future = Future()
            try:
                fut.set_result(self.backend.compile(params))
            except Exception as e:  # the cache was evicted in between and the compile failed: same as below
                fut.set_exception(e)
            return fut
        return self._compile_pool.submit(self.backend.compile, params)

    # ---- per-sequence matchers -----------------------------------------------------------------------
    def add(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        self.matchers[request_id] = matcher

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def accept(self, request_id: str, token: int) -> tuple[bool, str | None]:
        """Advance a sequence's matcher by its sampled token: (grammar finished, error or None)."""
        m = self.matchers.get(request_id)
        if m is None:
            return False, None
        if not m.consume_token(token) or m.is_error():
            return False, f"structured_outputs: the grammar rejected token {token}: {m.get_error() or 'no reason'}"
        return m.is_stopped(), None

    # ---- masks -----------------------------------------------------------------------------------------
    def start_masks(self, request_ids: list[str]) -> TokenMask | None:
        """Start filling the bitmask of the constrained rows among `request_ids` (the step's sampling rows,
        in order); None when no row is constrained."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self.matchers]
        if not rows:
            return None
        matchers = [(self.matchers[request_ids[r]], j) for j, r in enumerate(rows)]
        words = self.backend.bitmask_words
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.mask_threads)
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-mask")

        def fill() -> float:
            t0 = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
            return time.perf_counter() - t0

        return TokenMask(torch.tensor(rows, dtype=torch.long), bitmask, self._mask_pool.submit(fill))


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, kernels=None) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is clear, in place (float32 [R, V] logits)."""
    if kernels is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        kernels.apply_token_bitmask(logits, bitmask, rows)
        return
    vocab = logits.shape[1]
    rows, bitmask = rows.to(logits.device), bitmask.to(logits.device)  # filled on the host
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
