"""SamplingParams with vLLM's field names. temperature 0 means greedy."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_strings"}
        values.update(changes)
        return SamplingParams(**values)
