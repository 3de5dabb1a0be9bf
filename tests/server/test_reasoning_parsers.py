"""Reasoning parsers (pagedserve/entrypoints/openai/reasoning_parsers.py), no model needed: the expected
(reasoning_content, content) split of realistic outputs, and the streaming split against it under random
chunkings (`</think>` split across chunks included)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStreamer,
    get_reasoning_parser,
    register_reasoning_parser,
)

# (parser, text, reasoning, content)
EXAMPLES = [
    ("deepseek_r1", "Let me think: 2+2 is 4.\n</think>\n\nThe answer is 4.", "Let me think: 2+2 is 4.\n",
     "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>\nHmm.\n</think>\n\n4", "\nHmm.\n", "\n\n4"),
    ("deepseek_r1", "\n<think>Hmm.</think>4", "Hmm.", "4"),
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("deepseek_r1", "Cut off right at the end </thi", "Cut off right at the end </thi", None),
    ("deepseek_r1", "Quick.</think>", "Quick.", None),
    ("deepseek_r1", "</think>Only content", None, "Only content"),
    ("deepseek_r1", "Is x < y? Use <b> tags.</think>Yes, é ✓", "Is x < y? Use <b> tags.", "Yes, é ✓"),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("qwen3", "<think>\n\n</think>\n\nHello!", "\n\n", "\n\nHello!"),
    ("qwen3", "Hello! How can I help?", None, "Hello! How can I help?"),
    ("qwen3", "<think>\nCut off mid-thought", "\nCut off mid-thought", None),
    ("qwen3", "\n\n<think>x</think>y", "x", "y"),
    ("qwen3", "A stray </think> stays content", None, "A stray </think> stays content"),
    ("qwen3", "<think>2 < 3 </thin", "2 < 3 </thin", None),
    ("qwen3", "<thinking is a word", None, "<thinking is a word"),
    ("qwen3", "<th", None, "<th"),
    ("qwen3", "\n", None, "\n"),
]
IDS = [f"{i}-{name}" for i, (name, *_) in enumerate(EXAMPLES)]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), EXAMPLES, ids=IDS)
def test_extract(name, text, reasoning, content):
    assert get_reasoning_parser(name)().extract_reasoning(text) == (reasoning, content)


def stream(name: str, text: str, cuts: list[int]) -> None:
    parser = get_reasoning_parser(name)()
    want_reasoning, want_content = (part or "" for part in parser.extract_reasoning(text))
    streamer = ReasoningStreamer(parser)
    reasoning = content = ""
    steps = [(text[:cut], False) for cut in sorted(set(cuts))] + [(text, True)]
    for prefix, final in steps:
        r, c = streamer.update(prefix, final=final)
        reasoning, content = reasoning + r, content + c
        assert want_reasoning.startswith(reasoning) and want_content.startswith(content), (prefix, reasoning, content)
        assert "</think>" not in reasoning
    assert (reasoning, content) == (want_reasoning, want_content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), EXAMPLES, ids=IDS)
def test_stream_char_by_char(name, text, reasoning, content):
    stream(name, text, list(range(len(text) + 1)))


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), EXAMPLES, ids=IDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_random_chunks(name, text, reasoning, content, data):
    stream(name, text, data.draw(st.lists(st.integers(0, len(text)), max_size=10)))


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_stream_agrees_on_glued_fragments(name, data):
    fragments = ["<think>", "</think>", "<th", "</", "k>", "\n", " ", "a", "é"]
    text = "".join(data.draw(st.lists(st.sampled_from(fragments), max_size=12)))
    stream(name, text, data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1)))


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_end_token_split_across_chunks(name):
    streamer = ReasoningStreamer(get_reasoning_parser(name)())
    assert streamer.update("<think>so 4</th") == ("so 4", "")
    assert streamer.update("<think>so 4</think>\n") == ("", "\n")
    assert streamer.update("<think>so 4</think>\nFour.", final=True) == ("", "Four.")


def test_partial_holds_back_what_may_become_a_token():
    r1, qwen3 = get_reasoning_parser("deepseek_r1")(), get_reasoning_parser("qwen3")()
    assert r1.split_partial("\n<thi") == ("", "")
    assert r1.split_partial("Hmm </") == ("Hmm ", "")
    assert qwen3.split_partial("<thi") == ("", "")
    assert qwen3.split_partial("Hi") == ("", "Hi")


def test_unknown_parser_names_the_field():
    with pytest.raises(ValueError, match=r"^reasoning_parser: unknown parser 'x' \(choose from deepseek_r1, qwen3"):
        get_reasoning_parser("x")


def test_registering_a_parser_is_one_class():
    try:
        @register_reasoning_parser("test_thought")
        class ThoughtParser(ReasoningParser):
            """Like deepseek_r1 with other tokens: only the class attributes change."""

            start_token, end_token = "<thought>", "</thought>"

            def split(self, text, final):
                opened, body = self._opened(text, final)
                return ("", "") if opened is None else self._think(body, final)

        assert get_reasoning_parser("test_thought") is ThoughtParser and "test_thought" in REASONING_PARSERS
        assert ThoughtParser().extract_reasoning("<thought>a</thought>b") == ("a", "b")
        assert ThoughtParser().split_partial("a</thou") == ("a", "")
    finally:
        REASONING_PARSERS.pop("test_thought", None)
