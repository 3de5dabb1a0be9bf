"""Incremental detokenizing and stop strings (engine/stop.py OutputText) with the bundled tokenizer (no model
weights needed)."""

from __future__ import annotations

import pytest

from pagedserve.engine.stop import OutputText
from pagedserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld 🙂🎉 日本語 — naïve café, 1234 + 5678 = 6912\n\n  indented\ttab",
    "Ünïcödé: ßø Ελληνικά русский язык 👩‍👩‍👧 中文字符 🚀",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def tok(bundled_path) -> Tokenizer:
    return Tokenizer(bundled_path)


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    return tok.encode("Repeat after me:")


def feed(detok: OutputText, ids: list[int]) -> tuple[str | None, list[str], int]:
    """Add tokens until a stop; returns (stop, visible texts after each token, tokens consumed)."""
    visible = []
    for n, t in enumerate(ids, start=1):
        stop = detok.add_token(t)
        visible.append(detok.visible_text(finished=stop is not None))
        if stop is not None:
            return stop, visible, n
    return None, visible, len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, prompt_ids, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = OutputText(IncrementalDetokenizer(tok, prompt_ids), stop=[])
    stop, visible, _ = feed(detok, ids)
    assert stop is None
    full = tok.decode(ids)
    assert detok.text == full == text
    # Text only grows: nothing shown is ever taken back (no replacement characters mid-way).
    for a, b in zip(visible, visible[1:], strict=False):
        assert b.startswith(a)
    assert "\ufffd" not in "".join(visible)


def test_multibyte_characters_are_split_over_tokens(tok):
    """The emoji/CJK texts really exercise byte-fallback pieces (otherwise the test above proves less)."""
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    assert any("\ufffd" in tok.id_to_piece(i) for i in ids)


def test_first_token_keeps_its_leading_space(tok, prompt_ids):
    ids = tok.encode(" Paris is nice", add_special_tokens=False)
    detok = OutputText(IncrementalDetokenizer(tok, prompt_ids), stop=[])
    feed(detok, ids)
    assert detok.text == " Paris is nice"


@pytest.mark.parametrize(
    ("text", "stop_str"),
    [
        ("héllo wörld 🙂 after", "rld"),  # 'ör' + 'ld'
        ("héllo wörld 🙂 after", "wörld 🙂"),  # over three tokens
        ("prefix 日本語 suffix", "本語"),  # made of byte-fallback pieces
        ("The quick brown fox jumps over the lazy dog.", "fox jumps"),
        ("The quick brown fox jumps over the lazy dog.", "The"),  # in the very first token
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_caught_and_cut(tok, prompt_ids, text, stop_str, include):
    ids = tok.encode(text, add_special_tokens=False)
    detok = OutputText(IncrementalDetokenizer(tok, prompt_ids), stop=["never-there", stop_str],
                       include_stop_str_in_output=include)
    stop, visible, consumed = feed(detok, ids)
    assert stop == stop_str
    idx = text.index(stop_str)
    assert detok.text == (text[: idx + len(stop_str)] if include else text[:idx])
    assert detok.stop_string == stop_str
    # It stops at the token that completes the stop string, not later.
    assert stop_str in tok.decode(ids[:consumed]) and stop_str not in tok.decode(ids[: consumed - 1])
    # While running, the visible text never showed any part of the stop string that is then cut.
    if not include:
        for v in visible[:-1]:
            assert detok.text.startswith(v)


def test_stop_string_split_over_separately_added_tokens(tok, prompt_ids):
    """'STOP' built from pieces that are each a token of their own."""
    pieces = ["ab", "ST", "O", "P", "cd"]
    ids = []
    for p in pieces:
        enc = tok.encode(p, add_special_tokens=False)
        ids.extend(enc)
    detok = OutputText(IncrementalDetokenizer(tok, prompt_ids), stop=["STOP"])
    stop, visible, _ = feed(detok, ids)
    assert stop == "STOP"
    assert detok.text == "ab"
    assert all("S" not in v for v in visible[:-1])  # held back, never shown then retracted


def test_holdback_releases_everything_when_finished(tok, prompt_ids):
    ids = tok.encode("hello there friend", add_special_tokens=False)
    detok = OutputText(IncrementalDetokenizer(tok, prompt_ids), stop=["XYZW"])
    stop, _, _ = feed(detok, ids)
    assert stop is None
    assert detok.visible_text(finished=False) == "hello there friend"[:-3]
    assert detok.visible_text(finished=True) == "hello there friend"


def test_no_stop_strings_means_no_holdback(tok, prompt_ids):
    ids = tok.encode("abc def", add_special_tokens=False)
    detok = OutputText(IncrementalDetokenizer(tok, prompt_ids), stop=[])
    feed(detok, ids)
    assert detok.visible_text(finished=False) == "abc def"


def test_earliest_of_several_stop_strings_wins(tok, prompt_ids):
    """Both stop strings complete in the same token; the one that starts first cuts the text."""
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    detok = OutputText(IncrementalDetokenizer(tok, prompt_ids), stop=["own", "br"])
    stop, _, _ = feed(detok, ids)
    assert stop == "br"
    assert detok.text == "The quick "


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(tok):
    """Token-id prompts may end in the first bytes of a character; the output's text is its own tokens'."""
    partial = next(i for i in range(1000, 40000) if tok.id_to_piece(i).endswith("\ufffd"))
    prompt = tok.encode("Hello there my friend", add_special_tokens=False) + [partial]
    out = tok.encode('{"a": 1}', add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.decode(t) for t in out) == '{"a": 1}'
