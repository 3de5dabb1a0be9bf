"""Reasoning parsers: split a model's output into reasoning_content (its `<think>...</think>` part) and
content, for a finished output or one still streaming.

Content is kept exactly as the text after `</think>` (the newlines models put there included): simple and
predictable, and what vLLM does. A leading `<think>` may follow whitespace; the whitespace goes with it.

The streaming split (`split_partial`) only shows prefixes of the final split: it holds back a tail that
may still become `</think>` ("...so the answer is 4</thi"), and, at the very start, text that may still
become `<think>`. Both parsers decide from the start of the output, never from something that only a
later token could reveal, so nothing shown as content can turn out to be reasoning, or the reverse.
"""

from __future__ import annotations

from typing import ClassVar

from pagedserve.entrypoints.openai.registry import Registry


def _hold_back(text: str, marker: str) -> str:
    """text without a tail that may still grow into `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


class ReasoningParser:
    """Base class. A parser is `split(text, final)` -> (reasoning, content) with "" for none; final=False
    means the text may still grow, so both parts must be prefixes of what any continuation gives."""

    name: ClassVar[str] = ""
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of the finished output; None for an empty part."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def split_partial(self, text: str) -> tuple[str, str]:
        """Prefixes of (reasoning, content) that are safe to show for the output so far."""
        return self.split(text, final=False)

    def _opened(self, text: str, final: bool) -> tuple[bool | None, str]:
        """Whether the output opens with the start token, and the text after it (the whole text when it does
        not). None: the output so far may still become the start token (only when not final)."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_token):
            return True, stripped[len(self.start_token):]
        if not final and self.start_token.startswith(stripped):
            return None, ""
        return False, text

    def _think(self, body: str, final: bool) -> tuple[str, str]:
        """Split the text after an (explicit or implied) start token at the end token."""
        reasoning, end, content = body.partition(self.end_token)
        if end:
            return reasoning, content
        return (body if final else _hold_back(body, self.end_token)), ""


REASONING_PARSERS: Registry[type[ReasoningParser]] = Registry("reasoning_parser")
register_reasoning_parser = REASONING_PARSERS.register  # class decorator: @register_reasoning_parser("name")
get_reasoning_parser = REASONING_PARSERS.get_class


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills, QwQ, Qwen3 thinking-2507: the chat template may already have opened
    `<think>` in the prompt, so the output starts in reasoning whether or not it repeats the start token.
    Everything before `</think>` is reasoning, everything after it content; an output without `</think>`
    (cut off, or the model never closed it) is all reasoning, content None."""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        opened, body = self._opened(text, final)
        if opened is None:
            return "", ""
        return self._think(body, final)


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (hybrid thinking): the model writes `<think>` itself when it thinks. An output that opens with
    `<think>` is reasoning up to `</think>` and content after it (all reasoning when cut off before
    `</think>`); any other output is all content, a stray `</think>` in it included. Models whose template
    opens `<think>` in the prompt want deepseek_r1: reading a late `</think>` as the end of reasoning
    here would mean holding every non-thinking answer back until the end of the stream."""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        opened, body = self._opened(text, final)
        if opened is None:
            return "", ""
        if not opened:
            return "", text
        return self._think(body, final)


class ReasoningStreamer:
    """Turns the growing output text into (reasoning delta, content delta) pairs; with final=True the rest
    is flushed from extract_reasoning(text), so the deltas add up to exactly the non-streaming split."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._reasoning = ""
        self._content = ""

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        if final:
            reasoning, content = self.parser.extract_reasoning(text)
            reasoning, content = reasoning or "", content or ""
        else:
            reasoning, content = self.parser.split_partial(text)
        reasoning_delta = reasoning[len(self._reasoning):] if reasoning.startswith(self._reasoning) else ""
        content_delta = content[len(self._content):] if content.startswith(self._content) else ""
        self._reasoning += reasoning_delta
        self._content += content_delta
        return reasoning_delta, content_delta
