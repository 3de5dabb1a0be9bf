"""`pagedserve generate --explain`: one prompt's journey, printed."""

from __future__ import annotations

import re

import pytest

from pagedserve.entrypoints.cli.main import main

pytestmark = pytest.mark.slow


def test_explain_shows_tokens_blocks_steps_and_stop_reason(capsys):
    rc = main(["generate", "--explain", "--raw", "--dtype", "float32", "--max-tokens", "3",
               "--block-size", "4", "--num-kv-blocks", "16", "The capital of France is"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Prompt: 5 tokens" in out
    assert "' capital'" in out and "3575" in out  # token ids with their text pieces
    assert re.search(r"step 0: prefill 5 tokens \(positions 0–4\)", out)
    assert "blocks allocated: [0, 1]" in out
    assert "block table: tokens 0–3 → block 0, tokens 4–4 → block 1" in out
    assert out.count("decode 1 token") == 2
    assert out.count("top-5 candidates") == 3 and out.count("← chosen") == 3
    assert "Final block table" in out and "tokens 4–6 → block 1" in out
    assert "Stop reason: length (max_tokens=3 reached)" in out


def test_explain_wants_one_prompt(capsys):
    rc = main(["generate", "--explain", "--dtype", "float32", "--num-kv-blocks", "8", "a", "b"])
    assert rc == 2
    assert "exactly one prompt" in capsys.readouterr().err
