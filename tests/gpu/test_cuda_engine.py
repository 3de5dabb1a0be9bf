"""The CUDA path on a GPU (skipped where torch sees none; benchmarks/gpu/run.sh runs these on a lent GPU).

The CPU suite checks the same logic through Triton's interpreter and the eager graph stand-in
(tests/engine/test_cuda_path.py, tests/kernels/test_triton_attention.py); these run it natively: the
engine on cuda against HF transformers on the same GPU, CUDA graphs against eager steps, seeded sampling
on the GPU, the KV cache sized from GPU memory."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:", "The KV cache of a transformer", "1, 2, 3, 4,", "Paris is", "import torch"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def cuda_fp32_graphs():
    return LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16)


def test_kv_cache_is_sized_from_gpu_memory(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        llm = LLM(device="cuda", gpu_memory_utilization=0.2, max_num_seqs=16)
    eng = llm.engine
    assert eng.dtype == torch.bfloat16  # bf16 by default on cuda
    assert eng.kv_caches[0][0].device.type == "cuda"
    assert any("GPU memory: 0.2 of" in r.getMessage() for r in caplog.records)
    total = torch.cuda.mem_get_info()[1]
    assert 0 < eng.kv_manager.num_blocks * eng.block_bytes < 0.2 * total
    assert eng.runner.graphs is not None and eng.runner.graphs.sizes[-1] == 16


def test_greedy_equals_transformers_on_the_gpu(cuda_fp32_graphs, hf_gguf_parse_once):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cuda_fp32_graphs.engine.model_path
    with hf_gguf_parse_once():
        kw = dict(gguf_file=os.path.basename(path)) if path.endswith(".gguf") else {}
        src = os.path.dirname(path) if path.endswith(".gguf") else path
        tok = AutoTokenizer.from_pretrained(src, **kw)
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).to("cuda").eval()
    ids = [tok(p).input_ids for p in PROMPTS[:4]]
    outs = cuda_fp32_graphs.generate([{"prompt_token_ids": x} for x in ids], GREEDY, use_tqdm=False)
    for x, out in zip(ids, outs, strict=True):
        inp = torch.tensor([x], device="cuda")
        with torch.no_grad():
            gen = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=32,
                              min_new_tokens=0, eos_token_id=None, pad_token_id=tok.eos_token_id)
        expected = gen[0, len(x):].tolist()
        assert list(out.outputs[0].token_ids)[: len(expected)] == expected, tok.decode(x)


def test_cuda_graphs_equal_eager(cuda_fp32_graphs):
    eager = LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    graphs = cuda_fp32_graphs.engine.runner.graphs
    before = graphs.replays
    # Different lengths: the batch shrinks through sizes that pad (7 → 8, 5 → 8, 3 → 4).
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (32, 30, 24, 20, 16, 12, 8, 4)]
    a = [o.outputs[0].token_ids for o in cuda_fp32_graphs.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    assert a == b
    assert graphs.replays > before and graphs.padded_rows > 0


def test_seeded_sampling_on_the_gpu_repeats(cuda_fp32_graphs):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in cuda_fp32_graphs.generate(PROMPTS, params, use_tqdm=False)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=4321, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in cuda_fp32_graphs.generate(PROMPTS, other, use_tqdm=False)] != runs[0]
