"""Speculative decoding through the server: `serve --speculative-config` streams the same tokens as plain
decoding, and /metrics reports vLLM's spec_decode counters."""

from __future__ import annotations

import signal

import httpx
import pytest

openai = pytest.importorskip("openai")

from live_server import start_server  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.engine import LLMEngine  # noqa: E402
from pagedserve.entrypoints.cli.main import build_parser  # noqa: E402
from pagedserve.entrypoints.openai.api_server import build_app  # noqa: E402

pytestmark = pytest.mark.slow

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PROMPT = ("The committee met on Tuesday to review the budget, and after a long discussion it approved the new "
          "library.\nThe committee met on Tuesday to review the budget, and after")


def test_serve_flag_parses_the_json():
    args = build_parser().parse_args(["serve", "--speculative-config", SPEC])
    from pagedserve.entrypoints.cli.args import engine_config_from_args

    cfg = engine_config_from_args(args)
    assert cfg.speculative_config["num_speculative_tokens"] == 4
    with pytest.raises(ValueError, match="speculative_config"):
        engine_config_from_args(build_parser().parse_args(["serve", "--speculative-config", "{bad"]))


def test_streamed_tokens_and_metrics(llm_fp32):
    engine = LLMEngine(EngineConfig(dtype="float32", speculative_config=SPEC))
    app = build_app(engine)
    server, thread, url = start_server(app, timeout_graceful_shutdown=5)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        model = engine.served_model_name
        ref = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
        chunks = [c.choices[0].text for c in stream if c.choices]
        assert "".join(chunks) == ref.outputs[0].text
        # Several tokens per step arrive together: fewer chunks than tokens.
        assert len(chunks) < len(ref.outputs[0].token_ids)
        text = httpx.get(f"{url}/metrics").text

        def value(name: str, label: str = "") -> float:
            line = next(ln for ln in text.splitlines() if ln.startswith(name + "{") and label in ln)
            return float(line.rsplit(" ", 1)[1])

        stats = engine.stats().spec_decode
        assert value("pagedserve:spec_decode_num_drafts_total") == stats.num_drafts > 0
        assert value("pagedserve:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
        assert value("pagedserve:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens > 0
        per_pos = [value("pagedserve:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
                   for i in range(4)]
        assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
        assert value("pagedserve:generation_tokens_total") == engine.num_generation_tokens
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(30)
