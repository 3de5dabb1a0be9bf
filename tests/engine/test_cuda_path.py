"""The CUDA path, as far as a CPU can check it (tests/gpu runs the same on a GPU):

- the engine end to end on the Triton attention backend (its kernels through Triton's interpreter) with
  no C++ kernels, as on a GPU: greedy tokens equal the torch_ref reference engine;
- decode steps through the CUDA-graph runner (worker/cuda_graph.py) with the eager stand-in for capture:
  static buffers, padding to the captured sizes and slicing give the tokens of eager steps;
- the KV cache sized from GPU memory: the warm-up step and vLLM's arithmetic (gpu_memory_utilization);
- the device and graph settings are validated with errors that name the field.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.core.kv_math import GpuMemoryPlan
from pagedserve.worker.cuda_graph import default_sizes, eager_capture
from tests.engine.test_tensor_parallel import _prompts

pytest.importorskip("triton")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# As on a GPU: no C++ CPU kernels anywhere, the Triton backend for attention.
CUDA_LIKE = dict(dtype="float32", use_cpp_kernels=False, attention_backend="triton", num_kv_blocks=64,
                 max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, bundled_path):
    """A random Llama (4 query, 2 KV heads) with weights large enough that attention scores, and so positions
    and every cached K/V, change the tokens (at the usual 0.02 init a random model's attention is uniform)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.model.loader import load_hf_tokenizer

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-cuda")
    tok = load_hf_tokenizer(bundled_path)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.25)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", attention_backend="torch_ref", num_kv_blocks=64, max_num_seqs=8)
    prompts = _prompts(6, 1000)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm


def test_triton_backend_engine_equals_reference(tiny_dir, reference):
    prompts, expected, _ = reference
    llm = LLM(tiny_dir, **CUDA_LIKE)
    assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.kernels is None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_decode_graphs_equal_eager_steps(tiny_dir, reference):
    """Graphs at sizes 1, 2 and 4 with the eager stand-in: 6 prompts decode as batches of 6 (no graph: too
    big), then fewer as they finish; max_tokens differ so batches of 5, 3 and 1 get padded."""
    prompts, expected, ref = reference
    llm = LLM(tiny_dir, **CUDA_LIKE)
    runner = llm.engine.runner
    runner.enable_decode_graphs((1, 2, 4), max_blocks=8, capture=eager_capture)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 8, 3, 5, 6, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [e[: p.max_tokens] for e, p in zip(expected, params, strict=True)]
    assert runner.graphs.replays > 0 and runner.graphs.padded_rows > 0
    # Padded rows write no K/V: stale slots left in the static buffers (here: pointing into block 63,
    # which nobody holds) are not written when 3 decoding rows are padded to 4.
    graphs, k_cache = runner.graphs, runner.kv_caches[-1][0]
    graphs.slot_mapping[:4] = torch.arange(4) + 63 * 16
    k_cache[63].fill_(7.0)
    llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert torch.all(k_cache[63] == 7.0)
    # A prompt longer than the graphs' block tables: its decode steps run eagerly, with the same tokens.
    long = {"prompt_token_ids": list(range(1, 140))}  # 139 tokens + 8 > 8 blocks of 16
    replays = runner.graphs.replays
    assert (llm.generate([long], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            == ref.generate([long], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert runner.graphs.replays == replays


def test_graphs_need_the_triton_backend(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        llm.engine.runner.enable_decode_graphs((1,), 4, capture=eager_capture)


def test_default_capture_sizes():
    assert default_sizes(128) == (1, 2, 4, 8, *range(16, 129, 8))
    assert default_sizes(3) == (1, 2, 3)
    assert default_sizes(1000)[-1] == 256


class FakeMemory:
    """Scripted allocator statistics: 10 GiB of GPU, 1 GiB in use outside torch."""

    GiB = 1024**3

    def __init__(self, peak_extra: int) -> None:
        self.peak_extra = peak_extra
        self.calls: list[str] = []

    def total_and_free(self):
        return 10 * self.GiB, 10 * self.GiB - self.reserved() - 1 * self.GiB

    def allocated(self):
        return 2 * self.GiB

    def reserved(self):
        return 3 * self.GiB

    def reset_peak(self):
        self.calls.append("reset")

    def peak(self):
        self.calls.append("peak")
        return self.allocated() + self.peak_extra

    def release(self):
        self.calls.append("release")


def test_kv_cache_from_gpu_memory(tiny_dir):
    from pagedserve.worker.gpu_memory import plan_kv_cache, warm_up_step

    llm = LLM(tiny_dir, **CUDA_LIKE)
    eng = llm.engine
    model, backend = eng.runner.model, eng.runner.backend
    # The warm-up step is a real step: 40 tokens in 3 sequences, logits of each one's last token.
    logits = warm_up_step(model, backend, eng.model_config, 40, 3, 16, torch.float32, "cpu")
    assert logits.shape == (3, eng.model_config.vocab_size) and torch.isfinite(logits).all()
    mem = FakeMemory(peak_extra=512 * 1024**2)
    plan = plan_kv_cache(model, backend, eng.model_config, weight_bytes=2 * FakeMemory.GiB, utilization=0.9,
                         num_tokens=64, num_seqs=4, block_size=16, dtype=torch.float32, device="cpu", memory=mem)
    assert mem.calls[:3] == ["release", "reset", "peak"]  # the peak is read after the step, from a fresh reset
    assert (plan.weights, plan.peak_activation, plan.other) == (2 * FakeMemory.GiB, 512 * 1024**2, FakeMemory.GiB)
    # 0.9 × 10 GiB - 2 GiB weights - 0.5 GiB activations - 1 GiB elsewhere = 5.5 GiB of KV cache
    assert plan.kv_cache == int(9 * FakeMemory.GiB) - int(3.5 * FakeMemory.GiB)
    assert plan.num_blocks(1024**2) == 5632
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.3 of 10 GiB.*no room"):
        GpuMemoryPlan(10 * FakeMemory.GiB, 0.3, 2 * FakeMemory.GiB, FakeMemory.GiB, FakeMemory.GiB).num_blocks(1024)


def test_device_settings_are_validated(caplog):
    assert EngineConfig().device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert EngineConfig(device="cpu").attention_backend == "batched"
    with pytest.raises(ValueError, match="device: must be one of auto, cpu, cuda"):
        EngineConfig(device="tpu")
    for bad in (0, 1.5, "x"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=(0, 4))
    assert EngineConfig(cuda_graph_sizes=[8, 1, 8]).cuda_graph_sizes == (1, 8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda', but torch .* sees no CUDA GPU"):
            LLM(device="cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(device="cuda", tensor_parallel_size=2)


def test_cpu_without_the_interpreter_refuses_triton(monkeypatch):
    from pagedserve.attention import get_backend

    be = get_backend("triton")
    monkeypatch.setattr(be.tk, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        be.check_device("cpu")
    be.check_device("cuda")  # fine where a GPU runs it


def test_seeded_sampling_is_reproducible_on_the_backend(tiny_dir):
    """Per-request generators live on the sampler's device: the same seed gives the same tokens on a second
    run (another seed, other tokens)."""
    prompts = _prompts(2, 1000)
    llm = LLM(tiny_dir, **CUDA_LIKE)

    def run(seed):
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seed=seed, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = run(11)
    assert run(11) == first and run(12) != first
