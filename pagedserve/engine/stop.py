"""The one place that decides whether and why a sequence stops, and what text it shows.

After every sampled token, `check_stop` applies, in this order (as vLLM):
1. EOS (unless ignore_eos) and the request's stop token ids, once min_tokens are out. EOS adds no text;
   a stop token id adds its text only with include_stop_str_in_output.
2. stop strings, searched in the text as it grows (one split over several tokens is still caught) once the
   output is longer than min_tokens (vLLM's detokenizer: a stop string that ended before is not looked for
   again); the text is cut before the stop string (or after it, with include_stop_str_in_output).
3. max_tokens and max_model_len ("length"); a stop string completed by the last allowed token wins.

While a request runs, the last len(longest stop string) - 1 characters are held back from what is
shown (`OutputText.visible_text`), so a stop string is never streamed and then taken back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.core.request import RequestStatus

if TYPE_CHECKING:
    from pagedserve.core.request import Request
    from pagedserve.tokenizer import IncrementalDetokenizer


class OutputText:
    """One sample's generated text: detokenized piece by piece, cut at the first stop string."""

    def __init__(self, detok: IncrementalDetokenizer, stop: list[str], include_stop_str_in_output: bool = False
                 ) -> None:
        self.detok = detok
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stop_string: str | None = None

    def add_token(self, token_id: int, find_stop: bool = True) -> str | None:
        """Append one token's text; returns the stop string if the text now contains one (text is cut).
        find_stop False: append only (min_tokens not yet out)."""
        piece = self.detok.decode(token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self.holdback)  # a stop string can only end in the new piece
        self.text += piece
        if not self.stop or not find_stop:
            return None
        hits = [(idx, s) for s in self.stop if (idx := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        idx, s = min(hits)  # the earliest stop string in the text wins
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        self.stop_string = s
        return s

    def visible_text(self, finished: bool) -> str:
        """What can be shown now: all of it once finished, else all but the held-back tail."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]


def check_stop(req: Request, token: int, text: OutputText | None, max_model_len: int) -> RequestStatus | None:
    """Decide for `req`, whose newest output token is `token` (already appended), whether it stops now:
    the finished status, or None to go on. Adds the token's text to `text` where it shows any (None: the
    sequence has no text, e.g. token-level tests), and sets `req.stop_reason` (the stop token id or stop
    string) when one of them ended it."""
    p = req.sampling_params
    is_eos = not p.ignore_eos and token in req.eos_token_ids
    if req.num_output_tokens >= p.min_tokens:
        if is_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            if p.include_stop_str_in_output and text is not None:
                text.add_token(token)
            return RequestStatus.FINISHED_STOPPED
    if not is_eos and text is not None:  # the EOS token itself adds no text
        stop_string = text.add_token(token, find_stop=req.num_output_tokens > p.min_tokens)
        if stop_string is not None:
            req.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
