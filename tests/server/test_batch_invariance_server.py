"""Issue 13 as a user meets it: 32 greedy completions sent at once to the server give the same texts as the
same prompts sent one at a time — in the default mode and, with identical logprobs, in the strict mode."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from live_server import start_server

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.kernels import CpuKernels

DATA = json.loads((Path(__file__).resolve().parent.parent / "data" / "invariance_prompts.json").read_text())
PROMPTS = [p["prompt"] for p in DATA["prompts"]][1::2][:32]  # the other half of the set


def complete(url: str, prompt: str) -> tuple[str, list[float]]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": DATA["tokens"], "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_concurrent_completions_equal_one_at_a_time(strict):
    kernels = CpuKernels.build()
    engine = LLMEngine(EngineConfig(dtype="float32", batch_invariant=strict, num_kv_blocks=512))
    app = build_app(engine, log_interval_s=0)
    srv, thread, url = start_server(app, timeout_graceful_shutdown=5)
    try:
        alone = [complete(url, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: complete(url, p), PROMPTS))
        assert max(len(r.scheduled) for r in engine.step_records) > 8  # they really shared steps
        assert [t for t, _ in together] == [t for t, _ in alone]
        if strict or kernels.fixed_matmuls:
            # Bit-identical logits give identical logprobs (float32, never bf16-quantized).
            assert [lp for _, lp in together] == [lp for _, lp in alone]
    finally:
        srv.handle_exit(signal.SIGTERM, None)
        thread.join(30)
