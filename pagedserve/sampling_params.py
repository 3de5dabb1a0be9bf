"""SamplingParams with vLLM's field names. temperature 0 means greedy.

Every field is validated here (a ValueError naming the field); what depends on the model (token ids
within the vocabulary, top_k at most the vocabulary, max_tokens within max_model_len) is checked by the
engine when the request is added. The limits are the constants below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM; the n samples use seed, seed + 1, ...
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 128  # samples of one prompt
MAX_LOGPROBS = 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check_text(name: str, text: str) -> str:
    """`text` unless it is not valid Unicode (a lone surrogate cannot be encoded, nor tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode ({e.reason} at position {e.start})") from None
    return text


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (the chosen one is always included)
    skip_special_tokens: bool = True
    # The output must follow a JSON schema, regex, choice or grammar (structured_output/params.py);
    # `guided_decoding` is vLLM's older name for it.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        else:
            self.stop_strings = list(self.stop)
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("guided_decoding: give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        def in_range(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if not _is_number(v) or not (lo < v if lo_open else lo <= v) or not v <= hi:
                raise bad(name, f"must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        in_range("presence_penalty", -2.0, 2.0)
        in_range("frequency_penalty", -2.0, 2.0)
        in_range("repetition_penalty", *REPETITION_PENALTY_RANGE)
        in_range("temperature", 0.0, MAX_TEMPERATURE)
        in_range("top_p", 0.0, 1.0, lo_open=True)
        in_range("min_p", 0.0, 1.0)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if self.seed is not None:
            if not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX:
                raise bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
            if self.seed + self.n - 1 > SEED_MAX:
                raise bad("seed", f"must be <= {SEED_MAX - self.n + 1} with n={self.n} (sample i uses seed + i)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
            check_text("stop", s)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}
        values.update(changes)
        return SamplingParams(**values)
