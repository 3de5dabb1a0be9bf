"""The grammar backend: llguidance (JSON schemas, regexes, Lark and GBNF grammars) over the model's tokens.

`GuidanceBackend.compile(params)` turns a StructuredOutputsParams into a matcher in its initial state, or
a ValueError naming what is wrong with the schema, regex or grammar. Compiled matchers are cached by the
spec (LRU); every request gets its own `deep_copy()` of one, so compiling a schema once serves every
request that sends it. Building the llguidance view of the tokenizer takes about a second, once per
backend, on first use (never at engine start-up: most engines never see a constrained request).

Matchers advance with `consume_token`, and fill a row of a token bitmask (bit t of word t // 32 set: token
t allowed) for the next step; llguidance drops the GIL for both, so masks can be computed in a thread
beside the model's forward pass.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf

from pagedserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.tokenizer import Tokenizer

COMPILE_CACHE_SIZE = 256


def _no_additional_properties(schema):
    """A copy of `schema` where every object schema without additionalProperties gets false (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def ascii_digits(regex: str) -> str:
    """`\\d` as [0-9]: the regex engine's `\\d` is Unicode (it would let "🯸" pass for a digit), while users
    of guided regexes (vLLM's other backends, JSON schema patterns) mean ASCII digits."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (a JSON text) of a constraint; ValueError for a malformed spec."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.schema()
            if params.disable_additional_properties:
                schema = _no_additional_properties(schema)
            options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_digits(params.regex))
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"{params.source}: invalid {kind}: {e}") from None


def _first_line(text: str, limit: int = 500) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    head = lines[0] if lines else "unknown error"
    return head if len(head) <= limit else head[:limit] + "..."


class GuidanceBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        """vocab_size: the width of the model's logits (the bitmask covers at least that many tokens)."""
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                eos = self.eos_token_ids or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer.hf, n_vocab=self.vocab_size,
                                                                  eos_token=eos)
            return self._ll_tokenizer

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `params` (from the cache when the same spec was compiled before)."""
        return self.template(params).deep_copy()

    def template(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The cached matcher of `params` in its initial state, compiled first if needed; never advance it
        (requests get copies)."""
        key = params.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
        template = self._compile(params)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.cache_key() in self._cache

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = grammar_text(params)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)  # drops the GIL while it builds
        if matcher.is_error():
            raise ValueError(f"{params.source}: invalid {params.kind}: {_first_line(matcher.get_error())}")
        return matcher

    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)
