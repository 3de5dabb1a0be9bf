"""pagedserve's decoder against transformers' on tiny random models of every supported architecture
(Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) and on the bundled model: same logits (float32,
1e-4) over a paged KV cache whose block tables are shuffled."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedserve.attention import AttentionMetadata, get_backend
from pagedserve.kernels import CpuKernels
from pagedserve.model.loader import LoadedModel, load_model
from pagedserve.worker.kv_cache import allocate_kv_cache

# "fused": the batched backend plus the C++ fused norm / rotary+KV-write / SwiGLU kernels (as the engine
# runs it on the CPU); "batched" alone keeps the model's pure-PyTorch layer code.
BACKENDS = ("torch_ref", "batched", "fused")
TOL = 1e-4
VOCAB = 256
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


class PagedSequences:
    """Drives the model directly over a paged cache: blocks are handed out from a shuffled free list as
    sequences grow, so every block table is non-contiguous and the sequences' blocks interleave."""

    def __init__(self, lm: LoadedModel, backend: str, num_seqs: int, block_size: int = 4,
                 num_blocks: int = 96, seed: int = 0, dtype: torch.dtype = torch.float32,
                 kernels: CpuKernels | None = None) -> None:
        self.lm, self.block_size = lm, block_size
        built = kernels or CpuKernels.build()
        assert built is not None, "the C++ kernels must build here"
        # "batched" and "fused" both attend through the C++ decode kernel; only "fused" gives the model
        # the kernels too. "strict": the batch-invariant attention, with the kernels (the model's matmuls
        # must be set up with batch_invariant=True by the test).
        names = {"fused": "batched", "strict": "batch_invariant"}
        self.backend = get_backend(names.get(backend, backend), built)
        self.kernels = built if backend in ("fused", "strict") else None
        self.kv = allocate_kv_cache(lm.config, num_blocks, block_size, dtype)
        # Garbage in unused slots must never be read: fill the cache with large values first.
        for k, v in self.kv:
            k.normal_(0, 100.0)
            v.normal_(0, 100.0)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.tokens: list[list[int]] = [[] for _ in range(num_seqs)]

    def step(self, new: list[list[int]], all_logits: bool = False, rows: list[int] | None = None) -> torch.Tensor:
        """Append `new[i]` to sequence i (all in one flat batch); logits of each last token (or all, or of the flat
        batch's `rows`, increasing)."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for i, toks in enumerate(new):
            start = len(self.tokens[i])
            self.tokens[i] += toks
            while len(self.tables[i]) * self.block_size < len(self.tokens[i]):
                self.tables[i].append(self.free.pop())
            for j, t in enumerate(toks):
                pos = start + j
                ids.append(t)
                positions.append(pos)
                slots.append(self.tables[i][pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(len(toks))
            seq_lens.append(len(self.tokens[i]))
        width = max(len(t) for t in self.tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        qsl = torch.tensor([0] + query_lens).cumsum(0)
        meta = AttentionMetadata(torch.tensor(slots), tables, torch.tensor(seq_lens), qsl, query_lens,
                                 seq_lens, self.block_size)
        self.lm.model.set_kernels(self.kernels)  # the fixture's model is shared between backends
        index = torch.tensor(rows, dtype=torch.long) if rows is not None else None if all_logits else qsl[1:] - 1
        with torch.inference_mode():
            return self.lm.model(torch.tensor(ids), torch.tensor(positions), self.kv, self.backend, meta, index)


# Phi-4-mini style: LongRoPE over a partial rotary (a quarter of each 16-dim head here: 4 frequencies).
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
             "short_factor": [1.0, 1.3, 2.1, 3.5], "long_factor": [1.2, 2.0, 4.5, 9.0]}


def _hf_config(arch: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, initializer_range=0.08)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "llama3-rope":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_scaling=dict(LLAMA3_ROPE),
                           rope_theta=500000.0)
    if arch == "llama-bias":  # attention_bias puts a bias on q/k/v and o_proj; mlp_bias on the MLP
        return LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    if arch == "mistral":
        # one kv head (extreme GQA) and a sliding window shorter than the test sequences
        return MistralConfig(**dict(common, num_key_value_heads=1), tie_word_embeddings=False,
                             sliding_window=6)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen2-window":  # window on every layer
        return Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
                           max_window_layers=0)
    if arch == "qwen2-window-some":  # window from layer 1 on (max_window_layers)
        return Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
                           max_window_layers=1)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    if arch == "phi3":  # fused qkv / gate_up in the checkpoint, partial rotary, LongRoPE
        return Phi3Config(**dict(common, max_position_embeddings=256), original_max_position_embeddings=64,
                          rope_parameters=dict(PHI3_ROPE), tie_word_embeddings=False, pad_token_id=0)
    if arch == "gemma2":  # caps that bite at these scales; a window shorter than the test sequences
        return Gemma2Config(**common, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                            attn_logit_softcapping=1.5, final_logit_softcapping=4.0, pad_token_id=0)
    if arch in ("gemma3", "gemma3-long"):  # a sliding layer (base 10000) and a global one (base 1e6), QK-norm
        # gemma3-long: a window longer than the test sequences, so decode steps run in DecodeStack
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=6 if arch == "gemma3" else 64,
                                query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"],
                                pad_token_id=0)
    raise AssertionError(arch)


def _build_hf(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, arch)))
    hf = AutoModelForCausalLM.from_config(_hf_config(arch), attn_implementation="eager").float().eval()
    with torch.no_grad():  # non-trivial norms and biases so they are checked too
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
    return hf


ARCHS = ("llama", "llama3-rope", "llama-bias", "mistral", "qwen2", "qwen2-window", "qwen2-window-some", "qwen3",
         "phi3", "gemma2", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    hf = _build_hf(arch)
    d = tmp_path_factory.mktemp(f"tiny-{arch}")
    hf.save_pretrained(d)
    lm = load_model(str(d), "float32")
    return arch, hf, lm


def _prompts(n_lens=(5, 11, 3, 17), seed=1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in n_lens]


_HF_CACHE: dict[tuple[object, tuple[int, ...]], torch.Tensor] = {}  # keys hold the model: ids stay unique


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `ids` (memoised: both backends ask for the same)."""
    key = (hf, tuple(ids))
    if key not in _HF_CACHE:
        with torch.no_grad():
            _HF_CACHE[key] = hf(torch.tensor([ids])).logits[0].float()
    return _HF_CACHE[key]


def test_config_read(tiny):
    arch, hf, lm = tiny
    cfg = lm.config
    assert cfg.architecture == arch.split("-")[0].replace("llama3", "llama")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, hf.config.num_key_value_heads, 16)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (lm.model.lm_head is None) == cfg.tie_word_embeddings
    assert cfg.attention_bias == (arch.startswith("qwen2") or arch == "llama-bias")
    assert cfg.o_proj_bias == cfg.mlp_bias == (arch == "llama-bias")
    assert cfg.sliding_window == {"mistral": 6, "qwen2-window": 5, "qwen2-window-some": 5, "gemma2": 6,
                                  "gemma3": 6}.get(arch)
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    assert windows == {"mistral": [6, 6], "qwen2-window": [5, 5], "qwen2-window-some": [None, 5],
                       "gemma2": [6, None], "gemma3": [6, None]}.get(arch, [None, None])
    assert cfg.plain_decoder == (arch in ("llama", "llama3-rope", "llama-bias", "mistral") or arch.startswith("qwen2"))
    if arch == "phi3":
        assert cfg.rotary_dim == 8 and cfg.rope_scaling["rope_type"] == "longrope"
    if arch == "gemma3":
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10000.0)
    if arch == "llama3-rope":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.rope_theta == 500000.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_all_logits(tiny, backend):
    _, hf, lm = tiny
    prompts = _prompts()
    run = PagedSequences(lm, backend, len(prompts))
    logits = run.step(prompts, all_logits=True)
    ref = torch.cat([_hf_logits(hf, p) for p in prompts])
    assert logits.shape == ref.shape
    assert ref.abs().max() > 0.5  # the weights are not so small that any logits would pass
    assert (logits - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_batched_decode(tiny, backend):
    _, hf, lm = tiny
    prompts = _prompts(seed=2)
    run = PagedSequences(lm, backend, len(prompts), seed=3)
    logits = run.step(prompts)
    for i, p in enumerate(prompts):
        assert (logits[i] - _hf_logits(hf, p)[-1]).abs().max().item() <= TOL
    seqs = [list(p) for p in prompts]
    for _ in range(8):
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        logits = run.step([[t] for t in nxt])
        for i, s in enumerate(seqs):
            diff = (logits[i] - _hf_logits(hf, s)[-1]).abs().max().item()
            assert diff <= TOL, f"seq {i} at length {len(s)}: max |diff| {diff}"
    # the sequences' blocks really are scattered
    assert any(t != sorted(t) or t[-1] - t[0] != len(t) - 1 for t in run.tables)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_mixed_with_decode(tiny, backend):
    """A prompt prefilled in chunks (the later ones start at non-zero positions over cached context)
    in the same flat batch as a decoding sequence."""
    _, hf, lm = tiny
    a, b = _prompts((23, 6), seed=4)
    run = PagedSequences(lm, backend, 2, seed=5)
    run.step([a[:7], b])
    b_next = int(_hf_logits(hf, b)[-1].argmax())
    logits = run.step([a[7:16], [b_next]])
    assert (logits[0] - _hf_logits(hf, a[:16])[-1]).abs().max().item() <= TOL
    assert (logits[1] - _hf_logits(hf, b + [b_next])[-1]).abs().max().item() <= TOL
    logits = run.step([a[16:], [7]], all_logits=True)
    ref = torch.cat([_hf_logits(hf, a)[16:], _hf_logits(hf, b + [b_next, 7])[-1:]])
    assert (logits - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("backend", ["batched", "fused", "strict"])
def test_last_layer_computes_only_the_sampled_rows(tiny, backend, tmp_path):
    """A step where not every row samples runs its last layer past the K/V write for the sampled rows only
    (SampledRows): the same K/V in the cache as a step that computes every row, and the same logits for those rows
    (bit for bit in the strict mode, whose row kernel and fixed-order matmuls do not depend on the other rows).
    Rows that are not their sequence's last fall back to computing every row; a step where no row samples writes
    the same K/V and returns no logits."""
    arch, hf, lm = tiny
    if backend == "strict" and arch in ("phi3", "gemma2"):
        pytest.skip("the strict mode has no partial rotary / soft-capping")
    kernels = CpuKernels.build()
    if backend == "strict":  # a model of its own: the fixture's is shared
        hf.save_pretrained(tmp_path)
        lm = load_model(str(tmp_path), "float32")
        lm.model.setup_matmuls(kernels, pack=False, batch_hint=8, batch_invariant=True)
    a, b, c = _prompts((23, 6, 9), seed=16)
    last_mlp = lm.model.layers[-1].mlp
    seen: list[int] = []
    hook = last_mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    try:
        runs = []
        for _ in range(4):
            torch.manual_seed(18)  # the same garbage in the caches' unused slots
            runs.append(PagedSequences(lm, backend, 3, seed=17, kernels=kernels))
        # Steps: chunks of a and c (no row of them samples) beside b's whole prompt (rows 10-15), then the rest of
        # a and c beside b's decode (rows 12, 13 and 18 sample).
        first = [a[:10], b, c[:4]]
        outs = [runs[0].step(first, all_logits=True), runs[1].step(first, rows=[15]),
                runs[2].step(first, rows=[3, 15]), runs[3].step(first, rows=[])]
        assert seen == [20, 1, 20]  # all rows; only b's last; rows 3 and 15 (3 is not a's last: every row)
        second = [a[10:], [5], c[4:]]
        outs2 = [run.step(second, rows=None if i == 0 else [12, 13, 18], all_logits=i == 0)
                 for i, run in enumerate(runs)]
    finally:
        hook.remove()
    assert seen[3:] == [19, 3, 3, 3]  # no row samples: the MLP is skipped
    assert outs[3].shape[0] == 0
    for out, rows in ((outs[1], [15]), (outs[2], [3, 15])):
        assert out.shape[0] == len(rows)
        _assert_rows_equal(out, outs[0][rows], backend)
    for out in outs2[1:]:
        _assert_rows_equal(out, outs2[0][[12, 13, 18]], backend)
    for run in runs[1:]:
        for (k, v), (k0, v0) in zip(run.kv, runs[0].kv, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def _assert_rows_equal(got: torch.Tensor, want: torch.Tensor, backend: str) -> None:
    assert want.abs().max() > 0.5
    if backend == "strict":
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max().item() <= 1e-5


def test_unknown_architecture_lists_the_supported_ones():
    from pagedserve.model.config import ModelConfig

    cfg = _hf_config("llama").to_dict()
    cfg["architectures"] = ["FalconForCausalLM"]
    with pytest.raises(ValueError, match="FalconForCausalLM") as e:
        ModelConfig.from_hf_dict(cfg)
    for name in ("Gemma3ForCausalLM", "Gemma2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                 "LlamaForCausalLM", "gemma3"):
        assert name in str(e.value)


def test_qwen2_layer_types_decide_the_windows():
    from pagedserve.model.config import ModelConfig

    cfg = _hf_config("qwen2-window").to_dict()
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    cfg["layer_types"] = ["full_attention", "sliding_attention"]
    assert [ModelConfig.from_hf_dict(cfg).layer_window(i) for i in range(2)] == [None, 5]
    cfg["layer_types"] = ["full_attention", "full_attention"]
    assert ModelConfig.from_hf_dict(cfg).sliding_window is None
    cfg["use_sliding_window"] = False
    cfg["layer_types"] = ["sliding_attention"] * 2
    assert ModelConfig.from_hf_dict(cfg).sliding_window is None
    cfg["use_sliding_window"], cfg["layer_types"] = True, ["sliding_attention"]
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict(cfg)


def test_longrope_switches_to_the_long_factors_past_the_original_length():
    """Positions from original_max_position_embeddings on rotate with the long factors (transformers uses
    them for every position once a sequence is that long; here each position decides by itself)."""
    from transformers import AutoModelForCausalLM

    from pagedserve.model.config import ModelConfig

    hf = AutoModelForCausalLM.from_config(_hf_config("phi3"))
    cfg = ModelConfig.from_hf_dict(dict(hf.config.to_dict(), architectures=["Phi3ForCausalLM"]))
    from pagedserve.model.layers import RotaryEmbedding

    rot = RotaryEmbedding(cfg.rotary_dim, 256, cfg.rope_theta, cfg.rope_scaling)
    emb = hf.model.rotary_emb
    x = torch.zeros(1, 1, 16)
    for length, positions in ((64, torch.arange(64)), (100, torch.arange(64, 100))):
        cos, sin = emb(x, torch.arange(length).unsqueeze(0))  # transformers: factors for the whole length
        ours_cos, ours_sin = rot.cos_sin(positions)
        assert torch.allclose(ours_cos, cos[0, positions, : cfg.rotary_dim // 2], atol=1e-6)
        assert torch.allclose(ours_sin, sin[0, positions, : cfg.rotary_dim // 2], atol=1e-6)


def test_sharded_safetensors(tmp_path):
    hf = _build_hf("llama")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(Path(tmp_path).glob("*.safetensors"))) > 2
    lm = load_model(str(tmp_path), "float32")
    prompts = _prompts((9, 4), seed=6)
    logits = PagedSequences(lm, "batched", 2).step(prompts, all_logits=True)
    ref = torch.cat([_hf_logits(hf, p) for p in prompts])
    assert (logits - ref).abs().max().item() <= TOL


# ---- the bundled model ---------------------------------------------------------------------------
BUNDLED_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
]


@pytest.fixture(scope="module")
def hf_bundled_parsed_once(request, hf_gguf_parse_once):
    """conftest's hf_bundled (transformers' tokenizer and model from the bundled GGUF), loaded with one parse
    of the file instead of three (tokenizer, config, weights): the same model and tokenizer, faster."""
    with hf_gguf_parse_once():
        return request.getfixturevalue("hf_bundled")


def test_bundled_greedy_matches_transformers(llm_fp32, hf_bundled_parsed_once):
    from pagedserve import SamplingParams

    hf, tok = hf_bundled_parsed_once
    ids = [tok(p).input_ids for p in BUNDLED_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm_fp32.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    for x, out in zip(ids, outs, strict=True):
        inp = torch.tensor([x])
        with torch.no_grad():
            gen = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=32,
                              min_new_tokens=0, eos_token_id=None, pad_token_id=tok.eos_token_id)
        expected = gen[0, len(x):].tolist()
        got = list(out.outputs[0].token_ids)
        assert len(got) == 32
        # HF stops at EOS (pagedserve ignores it): compare what HF produced, which must be all of it
        # unless HF hit an EOS token.
        assert got[: len(expected)] == expected, tok.decode(x)
        if len(expected) < 32:
            assert expected[-1] in (hf.generation_config.eos_token_id, tok.eos_token_id)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma3", "gemma3-long"])
def test_bf16_fast_path_is_as_close_to_float32_as_transformers_bf16(arch, tmp_path):
    """bf16 cannot match float32 exactly; the fast path (packed oneDNN weights where the CPU has native
    bf16, the fused kernels, the decode kernel) must stay as close to the float32 reference as
    transformers' own bf16 model does, over a prefill and a few decode steps."""
    import copy

    hf = _build_hf(arch)
    hf.save_pretrained(tmp_path)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    lm = load_model(str(tmp_path), "bfloat16")
    lm.model.setup_matmuls(None, pack=True, batch_hint=8)
    prompts = _prompts((9, 14, 4), seed=7)
    # Gemma holds its norms' weights as 1 + w in bf16 (transformers holds w in bf16 and adds 1 in float32), so a single
    # step of either path may stray further than transformers' bf16 one: there the run's worst errors are compared.
    per_step = not arch.startswith("gemma")
    for backend in ("torch_ref", "fused"):
        worst = (0.0, 0.0)
        run = PagedSequences(lm, backend, len(prompts), dtype=torch.bfloat16, seed=8)
        seqs = [list(p) for p in prompts]
        logits = run.step(prompts)
        for step in range(4):
            for i, s in enumerate(seqs):
                exact = _hf_logits(hf, s)[-1]
                with torch.no_grad():
                    theirs = hf_bf16(torch.tensor([s])).logits[0, -1].float()
                ours = logits[i]
                err_ours = (ours - exact).abs().max().item()
                err_theirs = (theirs - exact).abs().max().item()
                if per_step:
                    assert err_ours <= 2 * err_theirs + 0.005, (backend, step, i, err_ours, err_theirs)
                worst = max(worst[0], err_ours), max(worst[1], err_theirs)
            nxt = [int(_hf_logits(hf, s)[-1].argmax()) for s in seqs]
            for s, t in zip(seqs, nxt, strict=True):
                s.append(t)
            logits = run.step([[t] for t in nxt])
        assert worst[0] <= 2 * worst[1] + 0.005, (backend, worst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama-bias", "qwen3", "gemma3-long", "gemma3"])
def test_decode_stack_equals_layer_by_layer_path(arch, dtype, tmp_path):
    """Decode steps of a few sequences run every layer in one C++ call; the result must be what the
    layer-by-layer fused path computes (bit for bit in float32: same kernels, same order). llama-bias: biases
    everywhere, so the stack's bias handling is checked too; qwen3: QK-norm; gemma3-long: QK-norm, the sandwich
    norms rounded once, GeGLU, the sliding layer's own rotary base, the embedding scale; gemma3: the same with a
    window (6) the sequences outgrow, which both paths' decode kernel applies."""
    hf = _build_hf(arch)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype)
    kernels = CpuKernels.build()
    lm.model.setup_matmuls(kernels, pack=True, batch_hint=8)
    prompts = _prompts((6, 13, 2), seed=10)
    runs = []
    for use_stack in (True, False):
        run = PagedSequences(lm, "fused", len(prompts), dtype=dtype, seed=11,
                             kernels=kernels.replace(decode_stack=use_stack))
        steps = [run.step(prompts)]
        for _ in range(6):
            steps.append(run.step([[t] for t in steps[-1].float().argmax(-1).tolist()]))
        runs.append(torch.stack(steps).float())
        assert (lm.model._stack is not None) == use_stack
    stacked, layered = runs
    if dtype == torch.float32:
        assert torch.equal(stacked, layered)
    else:
        assert torch.allclose(stacked, layered, atol=0.05, rtol=0.02)
        assert torch.equal(stacked.argmax(-1), layered.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "llama-bias", "qwen2", "mistral", "gemma3"])
def test_strict_mode_matches_transformers(arch, tmp_path):
    """The batch-invariant mode (fixed-order matmuls, every attention row through the row kernel) is as exact as the
    other paths: float32 logits of a chunked prefill mixed with decodes match HF; Mistral's and Gemma 3's sliding
    windows (6 positions) cut the 23-token prompt's context."""
    hf = _build_hf(arch)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), "float32")
    kernels = CpuKernels.build()
    lm.model.setup_matmuls(kernels, pack=False, batch_hint=8, batch_invariant=True)
    a, b = _prompts((23, 6), seed=12)
    run = PagedSequences(lm, "strict", 2, seed=13, kernels=kernels)
    run.step([a[:7], b])
    b_next = int(_hf_logits(hf, b)[-1].argmax())
    logits = run.step([a[7:], [b_next]], all_logits=True)
    ref = torch.cat([_hf_logits(hf, a)[7:], _hf_logits(hf, b + [b_next])[-1:]])
    assert logits.dtype == torch.float32 and ref.abs().max() > 0.5
    assert (logits - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["llama-bias", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strict_mode_decode_stack_and_layer_path_are_bit_identical(dtype, arch, tmp_path):
    """In the strict mode a few-sequence decode step gives the same bits through DecodeStack (its
    FIXED matmul route) as layer by layer, in bf16 too, and a sequence's logits do not change when
    another sequence joins its steps; with Gemma 3's sliding windows (6 positions, which the sequences outgrow) too."""
    hf = _build_hf(arch)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype)
    kernels = CpuKernels.build()
    lm.model.setup_matmuls(kernels, pack=True, batch_hint=8, batch_invariant=True)
    prompts = _prompts((6, 13, 2, 9, 4, 7), seed=14)
    runs = []
    # Three sequences (a few-rows step) and six (past GEMV_MAX_ROWS: the stack runs them too, every matmul being
    # on the fixed-order route at every row count).
    for use_stack, n in ((True, 3), (False, 3), (True, 1), (True, 6), (False, 6)):
        run = PagedSequences(lm, "strict", n, dtype=dtype, seed=15, kernels=kernels.replace(decode_stack=use_stack))
        steps = [run.step(prompts[:n])]
        for _ in range(5):
            steps.append(run.step([[t] for t in steps[-1].argmax(-1).tolist()]))
        runs.append(torch.stack(steps))
        assert (lm.model._stack is not None) == use_stack
    stacked, layered, alone, stacked6, layered6 = runs
    assert stacked.dtype == torch.float32
    assert torch.equal(stacked, layered)
    assert torch.equal(stacked[:, :1], alone)
    assert torch.equal(stacked6, layered6)
    assert torch.equal(stacked6[:, :3], stacked)
