"""Per-request output state: detokenizing, stops, logprobs, timings → RequestOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.stop import OutputText, check_stop
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SampleState:
    request: Request
    text: OutputText
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0


@dataclass
class ParentState:
    """One user request; n > 1 fans out into n sequences that share the prompt's KV blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    metrics: RequestMetrics
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def new_sample(self, request: Request) -> SampleState:
        p = request.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens)
        text = OutputText(detok, p.stop_strings, p.include_stop_str_in_output)
        return SampleState(request, text, [] if p.logprobs is not None else None)

    def on_token(self, sample: SampleState, token_id: int, logprob) -> RequestStatus | None:
        """Record one new token (already appended to the request); returns the status it finishes with."""
        if logprob is not None and sample.logprobs is not None:
            chosen, rank, top_ids, top_vals = logprob
            entry = {token_id: Logprob(chosen, rank, self.tokenizer.id_to_piece(token_id))}
            for r, (tid, val) in enumerate(zip(top_ids, top_vals, strict=True), start=1):
                entry.setdefault(tid, Logprob(val, r, self.tokenizer.id_to_piece(tid)))
            sample.logprobs.append(entry)
            sample.cumulative_logprob += chosen
        return check_stop(sample.request, token_id, sample.text, self.max_model_len)

    @staticmethod
    def make_output(parent: ParentState) -> RequestOutput:
        outputs = []
        for s in parent.samples:
            req = s.request
            outputs.append(
                CompletionOutput(
                    index=req.index,
                    text=s.text.visible_text(req.is_finished),
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    logprobs=s.logprobs,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        finished = parent.finished
        if finished and parent.metrics.finished_time is None:
            parent.metrics.finished_time = time.time()
        cached = max((s.request.num_cached_tokens for s in parent.samples), default=0)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=max(cached, 0),
            error=parent.error,
        )
