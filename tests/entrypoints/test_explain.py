"""`pagedserve generate --explain`: one prompt's journey, printed."""

from __future__ import annotations

import json
import re

import pytest
from trace_helpers import SPEC_CONFIG, SPEC_PROMPTS, spec_trace

from pagedserve.entrypoints.cli import explain
from pagedserve.entrypoints.cli.explain import REQUEST_ID, piece
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


def test_explain_with_speculation_shows_drafts_and_what_was_kept(capsys, monkeypatch):
    """An n-gram run on a prompt that repeats itself: proposals, accepted counts, the model's own token at the
    first rejected draft (or the bonus token), and one candidates table per token even when a step adds several.
    It runs on the speculative trace's engine (one model load less); its numbers are checked against that
    engine's step records and stats."""
    engine, recorder, *_ = spec_trace()
    configs = []

    def shared_engine(config):
        configs.append(config)
        return engine

    monkeypatch.setattr(explain, "LLMEngine", shared_engine)
    monkeypatch.setenv("COLUMNS", "250")  # no line wrapping in the captured output
    before, first_step = engine.stats().spec_decode, engine.step_count
    rc = main(["generate", "--explain", "--raw", "--dtype", "float32", "--max-tokens", "16", "--block-size", "4",
               "--speculative-config", json.dumps(SPEC_CONFIG), SPEC_PROMPTS[0]])
    assert rc == 0
    assert configs[0].speculative_config["num_speculative_tokens"] == 4
    out = capsys.readouterr().out
    after = engine.stats().spec_decode
    tok = engine.tokenizer
    drafted = [(r.step, r.spec_drafts[REQUEST_ID], r.spec_accepted[REQUEST_ID]) for r in engine.step_records
               if r.step >= first_step and REQUEST_ID in r.spec_drafts]
    assert len(drafted) == after.num_drafts - before.num_drafts >= 2
    assert sum(a for *_, a in drafted) == after.num_accepted_tokens - before.num_accepted_tokens > 0
    assert "Speculative decoding: ngram, up to 4 draft tokens a step" in out
    lines = re.findall(r"step (\d+): decode 1 token \+ (\d+) draft tokens? \((\d+) accepted\) \(positions (\d+)–", out)
    assert lines == [(str(s), str(len(d)), str(a), lines[i][3]) for i, (s, d, a) in enumerate(drafted)]
    n_prompt = len(tok.encode(SPEC_PROMPTS[0]))
    assert lines[0][3] == str(n_prompt)  # the first decode step scores the token at the prompt's end + 4 drafts
    for _, d, _ in drafted:
        assert f"proposed {len(d)} draft tokens: " + ", ".join(f"{t} {piece(tok.id_to_piece(t))}" for t in d) in out
    assert re.findall(r"kept (\d+) of (\d+)", out) == [(str(a), str(len(d))) for _, d, a in drafted]
    full = [a for _, d, a in drafted if a == len(d)]
    assert full and len(full) < len(drafted), "the run should have both fully accepted and rejected drafts"
    assert out.count("all accepted, then the bonus token") == out.count("(bonus token)") == len(full)
    assert out.count("rejected: the model chose") == out.count("(instead of the rejected draft)") \
        == len(drafted) - len(full)
    assert out.count("(accepted draft)") == sum(a for *_, a in drafted)
    assert out.count("top-5 candidates") == out.count("← chosen") == 16  # one table per generated token
    assert "draft lookahead blocks returned to the pool" in out
    # Same text as the traced run of this prompt, and the engine's totals in the result.
    assert f"Generated 16 tokens: {recorder.outputs['s0'].outputs[0].text!r}" in out
    assert (f"Speculation: {after.num_drafts} proposals, {after.num_draft_tokens} draft tokens, "
            f"{after.num_accepted_tokens} accepted") in out
