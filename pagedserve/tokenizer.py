"""Tokenizer front: HF tokenizer + chat template, and incremental detokenizing with stop strings.

The incremental detokenizer uses tokenizers' DecodeStream (it handles UTF-8 split over tokens and
byte-fallback) seeded with the end of the prompt so the first word keeps its leading space. Stop strings
are searched in the text as it grows (a stop string split across tokens is still caught); while a
request runs, the last len(longest stop) - 1 characters are held back from streams so a stop string is
never shown and then taken back.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pagedserve.model.loader import load_hf_tokenizer


class Tokenizer:
    def __init__(self, path: str) -> None:
        self.hf = load_hf_tokenizer(path)
        self.backend = self.hf.backend_tokenizer if hasattr(self.hf, "backend_tokenizer") else self.hf._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not messages:
            raise ValueError("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: each message needs a 'role' and a 'content'")
        if not self.has_chat_template:
            raise ValueError("messages: this model has no chat template; use a plain prompt")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


class IncrementalDetokenizer:
    """Turns one sequence's new tokens into text and watches for stop strings."""

    CONTEXT_TOKENS = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        context = prompt_token_ids[-self.CONTEXT_TOKENS :]
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stop_string: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text is cut)."""
        piece = self.stream.step(self.tokenizer.backend, token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += piece
        if not self.stop:
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
