"""`pagedserve bench roofline`: the workload arithmetic against independent counts (torch's FLOP counter on
HF transformers' model, the GGUF file's own tensor sizes), and the command end to end (never a speed)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.entrypoints.cli import roofline as rl
from pagedserve.entrypoints.cli.main import main
from pagedserve.model.config import ModelConfig


def test_flop_model_matches_torch_flop_counter_on_transformers():
    """The matmul FLOPs per token, the LM head's and attention's, against FlopCounterMode over HF's Llama
    (eager attention computes the full n × n scores; pagedserve's count is the causal half)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=500, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, attn_implementation="eager")
    cfg = ModelConfig("llama", vocab_size=500, hidden_size=96, intermediate_size=160, num_layers=3, num_heads=6,
                      num_kv_heads=2, head_dim=16)
    model = LlamaForCausalLM(hf_cfg).eval()
    n = 40
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.randint(0, 500, (1, n)))
    counts = {str(op).split(".")[-1]: v for op, v in counter.get_flop_counts()["Global"].items()}
    linear = counts.get("mm", 0) + counts.get("addmm", 0)
    assert linear == n * (rl.matmul_flops_per_token(cfg) + rl.head_flops(cfg))  # HF scores every position
    assert counts["bmm"] == pytest.approx(n * rl.attention_flops(cfg, n))  # full square
    # A request's FLOPs row by row and layer by layer: every layer computes a fed row's K/V; everything else of the
    # row (q, o, the MLP, attention over its position + 1 keys) in the last layer only where its logits are taken.
    for prompt, out in ((n, 0), (n, 1), (n, 7), (1, 1), (3, 5)):
        per_layer = rl.matmul_flops_per_token(cfg) / cfg.num_layers
        kv = 2 * 96 * 2 * 2 * 16
        fed = prompt + max(out - 1, 0)
        total = out * rl.head_flops(cfg)
        for pos in range(fed):
            sampled = pos >= fed - out
            for layer in range(cfg.num_layers):
                full = layer < cfg.num_layers - 1 or sampled
                total += per_layer if full else kv
                total += 4 * 6 * 16 * (pos + 1) if full else 0
        assert rl.batch_flops(cfg, 2, prompt, out) == pytest.approx(2 * total), (prompt, out)


def test_standard_workloads_of_the_bundled_shape():
    """SmolLM2-135M: W1 about 8.0 TFLOP, W3 about 3.9 TFLOP (the issue's 7.9 and 4.0; W3's last layer computes
    little more than the K/V of all but 16 of its rows)."""
    cfg = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64)
    assert rl.batch_flops(cfg, 128, 128, 128) / 1e12 == pytest.approx(8.04, abs=0.01)
    assert rl.batch_flops(cfg, 16, 1024, 1) / 1e12 == pytest.approx(3.93, abs=0.01)


@pytest.mark.slow
def test_decode_bytes_are_the_gguf_blocks_read_in_place(llm_fp32, bundled_path):
    """float32 on the bundled Q4_1 file: every matmul (and the tied head) reads its GGUF blocks in place, so
    a decode step reads every 2-D tensor of the file once, plus the K/V of its context."""
    import gguf

    eng = llm_fp32.engine
    if not eng.runner.model.holds_blocks:
        pytest.skip("GGUF blocks are not read in place here (no C++ kernels)")
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(bundled_path).tensors if len(t.shape) == 2)
    cfg = eng.model_config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 100
    assert rl.decode_read_bytes(eng.runner.model, cfg, 100, 4) == file_bytes + kv


@pytest.mark.slow
def test_bench_roofline_puts_results_against_their_limits(tmp_path, monkeypatch):
    monkeypatch.setattr(rl, "_cache_file", lambda: tmp_path / "roofline.json")
    monkeypatch.setattr(rl, "BANDWIDTH_BYTES", 64 * 1024**2)
    run = {"mode": "throughput", "num_prompts": 2, "input_len": 16, "output_len": 8, "elapsed_s": 2.0,
           "output_tokens_per_s": 8.0, "prompt_tokens_per_s": 16.0}
    lat = {"mode": "latency", "input_len": 32, "output_len": 16, "decode_tokens_per_s": 50.0}
    (tmp_path / "tp.json").write_text(json.dumps(run))
    (tmp_path / "lat.json").write_text(json.dumps(lat))
    out = tmp_path / "roof.json"
    assert main(["bench", "roofline", "--dtype", "float32", "--quiet", "--results", str(tmp_path / "tp.json"),
                 str(tmp_path / "lat.json"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    m = r["machine"]
    assert m["gemm_gflops"]["float32"] > 0 and m["gemm_gflops"]["bfloat16"] > 0 and m["read_gb_s"] > 0
    assert set(r["workloads"]) == {"W1", "W2", "W3"}
    tp, lt = r["runs"]
    assert tp["share"] == pytest.approx(tp["total_gflop"] / m["gemm_gflops"]["float32"] / 2.0)
    assert lt["share"] == pytest.approx(50.0 / lt["limit_decode_tokens_per_s"])
    assert lt["limit_decode_tokens_per_s"] == pytest.approx(m["read_gb_s"] * 1e9 / lt["bytes_per_token"])
    # Kept for the other bench modes: the same machine key answers without measuring again.
    kept = json.loads((tmp_path / "roofline.json").read_text())
    assert len(kept) == 1 and rl.cached_or_measure().read_gb_s == m["read_gb_s"]
