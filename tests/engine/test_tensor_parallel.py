"""Tensor parallelism: ranks as processes over torch.distributed (gloo) on loopback.

The references are the same model on one process (TP=1): greedy tokens must be identical and, in float32,
the logits equal within 1e-5 (only the order of the all-reduce's sums differs). Covered: a rank started
from another "machine" (`pagedserve worker` through env://), spawned local ranks, a KV head replicated
over more ranks than there are KV heads, the bundled model's 9/3 heads over 3 ranks, a rank that dies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.executor.parallel_state import free_port
from pagedserve.executor.tensor_parallel import plan, rank_config
from pagedserve.model.config import ModelConfig

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompts(n: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [{"prompt_token_ids": torch.randint(0, vocab, (int(l),), generator=g).tolist()}
            for l in torch.randint(3, 60, (n,), generator=g)]


def _cfg(heads: int, kv: int, inter: int = 128, vocab: int = 1000) -> ModelConfig:
    return ModelConfig("llama", vocab_size=vocab, hidden_size=64, intermediate_size=inter, num_layers=2,
                       num_heads=heads, num_kv_heads=kv, head_dim=16)


def test_plan_splits_heads_mlp_and_vocabulary():
    p = plan(_cfg(4, 2, vocab=1001), 2)
    assert (p.num_heads, p.num_kv_heads, p.kv_replicas, p.intermediate_size) == (2, 1, 1, 64)
    assert p.vocab_per_rank == 501 and p.vocab_range(1, 1001) == (501, 1001)  # padded: same rows per rank
    # Fewer KV heads than ranks: each KV head is held by 2 ranks, the one its query heads read.
    p = plan(_cfg(4, 2), 4)
    assert (p.num_heads, p.num_kv_heads, p.kv_replicas) == (1, 1, 2)
    assert [p.kv_head_start(r) for r in range(4)] == [0, 0, 1, 1]
    assert rank_config(_cfg(4, 2), p).num_kv_heads == 1
    # The bundled model's shape: 9 query and 3 KV heads.
    assert plan(_cfg(9, 3, inter=1536), 3).num_kv_heads == 1
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 .*9 attention heads.*1, 3, 9"):
        plan(_cfg(9, 3, inter=1536), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size.*KV heads"):
        plan(_cfg(6, 4), 3)  # neither 4 % 3 nor 3 % 4
    with pytest.raises(ValueError, match="tensor_parallel_size.*MLP width 130"):
        plan(_cfg(4, 2, inter=130), 4)


def test_indivisible_model_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 .*9 attention heads"):
        LLM(dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tp_local_ranks"):
        LLM(dtype="float32", tensor_parallel_size=3, tp_local_ranks=4)


def _tiny_model(d, tokenizer_path: str, kv_heads: int) -> str:
    """A random Llama with 4 query heads, biases on every projection and an untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.model.loader import load_hf_tokenizer

    torch.manual_seed(0)
    tok = load_hf_tokenizer(tokenizer_path)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, bundled_path):
    return _tiny_model(tmp_path_factory.mktemp("tiny-tp"), bundled_path, kv_heads=2)


def _run(llm: LLM, prompts, params=GREEDY):
    logits: list[torch.Tensor] = []
    llm.engine.runner.on_logits = lambda ids, lg: logits.append(lg.clone())
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.runner.on_logits = None
    return [o.outputs[0].token_ids for o in outs], logits


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    return llm, _run(llm, _prompts(32, 1000))


def test_tp2_across_machines_equals_tp1(tiny_dir, tiny_reference, monkeypatch):
    """Rank 1 as another machine would start it: `pagedserve worker` meeting rank 0 through env://."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    worker = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli.main", "worker",
                               "--tensor-parallel-size", "2", "--rank", "1"], env=env)
    try:
        llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=128, max_num_seqs=8, tensor_parallel_size=2,
                  tp_local_ranks=1)
        ref_llm, (ref_tokens, ref_logits) = tiny_reference
        # Each rank's block holds its own KV head: half the bytes of one process's block.
        assert llm.engine.block_bytes * 2 == ref_llm.engine.block_bytes
        assert llm.engine.kv_caches[0][0].shape[2] == 1 and ref_llm.engine.kv_caches[0][0].shape[2] == 2
        tokens, logits = _run(llm, _prompts(32, 1000))
        assert tokens == ref_tokens
        assert len(logits) == len(ref_logits)
        assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True)) < 1e-5
        llm.engine.shutdown()
        assert worker.wait(timeout=30) == 0  # the worker left when rank 0 said stop
    finally:
        if worker.poll() is None:
            worker.kill()


def test_replicated_kv_head_equals_tp1_and_a_dead_rank_is_an_error(tmp_path, bundled_path):
    """2 ranks, 1 KV head: both ranks hold it (replicated), each with 2 of the 4 query heads. Then rank 1
    dies: the requests of the next step end with an error (no hang), and the executor reports the rank."""
    d = _tiny_model(tmp_path, bundled_path, kv_heads=1)
    prompts = _prompts(8, 1000)
    ref, _ = _run(LLM(d, dtype="float32", num_kv_blocks=64, max_num_seqs=8), prompts)
    llm = LLM(d, dtype="float32", num_kv_blocks=64, max_num_seqs=8, tensor_parallel_size=2)
    try:
        assert llm.engine.kv_caches[0][0].shape[2] == 1  # the whole (one) KV head on each rank
        tokens, _ = _run(llm, prompts)
        assert tokens == ref
        executor = llm.engine.executor
        assert executor.check_health() is None
        executor.procs[0].kill()  # rank 1
        executor.procs[0].join(10)
        assert "rank 1 exited" in executor.check_health()
        start = time.monotonic()
        outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 60
        assert all(o.outputs[0].finish_reason == "abort" for o in outs)
        assert all("tensor-parallel" in (o.error or "") or "engine error" in (o.error or "") for o in outs)
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def bundled_hf_dir(tmp_path_factory, request, hf_gguf_parse_once):
    """The bundled model's weights as an HF directory (every rank loads it quickly: safetensors), from
    conftest's hf_bundled (transformers' load of the GGUF, with one parse of the file)."""
    from safetensors.torch import save_file

    with hf_gguf_parse_once():
        model, tok = request.getfixturevalue("hf_bundled")
    d = tmp_path_factory.mktemp("bundled-hf")
    # transformers refuses to re-save a GGUF-loaded model; the tied head is the embedding (not stored twice).
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(d / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    (d / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(d)
    return str(d)


def test_tp3_on_the_bundled_model_equals_tp1(bundled_hf_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=10)
    one = LLM(bundled_hf_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    three = LLM(bundled_hf_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, tensor_parallel_size=3)
    try:
        assert three.engine.block_bytes * 3 == one.engine.block_bytes  # 3 KV heads: one per rank
        assert [o.outputs[0].token_ids for o in three.generate(prompts, params, use_tqdm=False)] == ref
    finally:
        three.engine.shutdown()
