"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "path/or/hub-id", "num_speculative_tokens": 4}

pagedserve adds three optional keys:
- `draft_num_layers` (draft_model): keep only the draft's first N layers (with its final norm and head). With
  no `model` the draft is the target's own first layers (a "self-draft"), which needs no second checkpoint.
- `disable_by_batch_size` (as vLLM v0's `speculative_disable_by_batch_size`): no request speculates in a step
  while more than this many requests are running (null: no limit). The default, 1, keeps speculation to a
  single stream: on a CPU a verification of one stream's 4 positions runs as one 4-row decode (the C++
  decode stack), but two streams' 8 positions take the layer-by-layer path at about 3× the cost of their
  plain step, and a large batch is compute-bound, so there a guessed token costs as much as a real one.
- `backoff` (default true): a request whose drafts keep being rejected stops proposing for 2, 4, ... 64 steps,
  so speculation costs little on text that does not repeat itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 1
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither prompt_lookup_min nor _max is given


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_num_layers: int | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    backoff: bool = True

    def __post_init__(self) -> None:
        f = "speculative_config"
        if self.method not in METHODS:
            raise ValueError(f"{f}.method: must be one of {list(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{f}.num_speculative_tokens: must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {k!r}")
        for name in ("prompt_lookup_max", "prompt_lookup_min", "draft_num_layers", "disable_by_batch_size"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{f}.{name}: must be a positive integer, got {v!r}")
        if not isinstance(self.backoff, bool):
            raise ValueError(f"{f}.backoff: must be true or false, got {self.backoff!r}")
        if self.method == "ngram":
            if self.model is not None or self.draft_num_layers is not None:
                raise ValueError(f"{f}.model: the ngram method takes no draft model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise ValueError(f"{f}.prompt_lookup_min: {lo} exceeds prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError(f"{f}.prompt_lookup_max: only the ngram method looks up the prompt")
            if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
                raise ValueError(f"{f}.model: must be a model path or hub id, got {self.model!r}")
            if self.model is None and self.draft_num_layers is None:
                raise ValueError(f"{f}.model: the draft_model method needs a draft model (or draft_num_layers "
                                 "for a self-draft of the target's first layers)")

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict or its JSON text (the CLI's `--speculative-config`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {type(value).__name__}")
        value = dict(value)
        known = {fl.name for fl in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key (known: {sorted(known)})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        method = value.get("method")
        if method is None:  # vLLM: a model and no method means a draft model
            method = "draft_model" if value.get("model") is not None else None
        if method == "[ngram]":
            method = "ngram"
        if method is None:
            raise ValueError("speculative_config.method: required (ngram or draft_model)")
        value["method"] = method
        return cls(**value)

    def to_dict(self) -> dict:
        return {fl.name: getattr(self, fl.name) for fl in fields(self)}
