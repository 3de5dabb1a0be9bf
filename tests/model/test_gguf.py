"""GGUF loading: every supported ggml type dequantizes exactly as the gguf package's reference, on real
tensors of the bundled model re-quantized into each type (and on valid random K-quant blocks, which the
gguf package cannot quantize); llama.cpp's q/k row permutation is undone; whole tiny GGUF models load
and, in F32, give transformers' logits."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pagedserve.model import loader
from pagedserve.model.loader import dequantize_gguf_tensor, iter_gguf_tensors, unpermute_qk

QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the fp16 super-block scales (d, and dmin where there is one) in each K-quant block.
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# Worst relative (to max |w|) error each type may add to a real weight matrix: a sanity bound showing the
# data survived the round trip, not a quality claim.
ROUND_TRIP_TOL = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.1,
                  "Q5_0": 0.08, "Q5_1": 0.05}
REAL_TENSORS = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Valid raw K-quant data: random quants and sub-block scales, finite small fp16 super-block scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[QT[qtype]]
    assert cols % block == 0
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-3, 2e-2, size=(rows, cols // block)).astype(np.float16)
        raw[..., off : off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * nbytes)


def encode(w: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "F32":
        return w.astype(np.float32)
    if qtype == "F16":
        return w.astype(np.float16)
    return gguf.quants.quantize(w.astype(np.float32), QT[qtype])


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama",
               meta: dict[str, int | float] | None = None) -> Path:
    """tensors: name → (encoded data, type name). F32/F16 arrays go as such, everything else as raw bytes."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    for name, (data, qtype) in tensors.items():
        if qtype in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data.view(np.uint8), raw_dtype=QT[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    data = np.asarray(gguf.quants.dequantize(data, QT[qtype]), dtype=np.float32)
    return torch.from_numpy(data.reshape(shape))


@pytest.fixture(scope="module")
def real_weights(bundled_path) -> dict[str, np.ndarray]:
    """A few real weight matrices of the bundled model, float32 (rows cut to keep the test quick)."""
    reader = gguf.GGUFReader(bundled_path)
    out = {}
    for t in reader.tensors:
        if t.name in REAL_TENSORS:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            out[t.name] = np.ascontiguousarray(w.reshape(tuple(int(d) for d in reversed(t.shape)))[:192])
    assert set(out) == set(REAL_TENSORS)
    return out


@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_dequantize_real_tensors(tmp_path, real_weights, qtype):
    encoded = {name: encode(w, qtype) for name, w in real_weights.items()}
    path = write_gguf(tmp_path / f"{qtype}.gguf", {n: (e, qtype) for n, e in encoded.items()})
    reader = gguf.GGUFReader(str(path))
    assert {t.name for t in reader.tensors} == set(REAL_TENSORS)
    for t in reader.tensors:
        assert t.tensor_type.name == qtype
        src = real_weights[t.name]
        got = dequantize_gguf_tensor(t)
        assert got.dtype == torch.float32 and tuple(got.shape) == src.shape
        assert torch.equal(got, reference(encoded[t.name], qtype, src.shape))
        err = (got - torch.from_numpy(src)).abs().max().item() / float(np.abs(src).max())
        assert err <= ROUND_TRIP_TOL[qtype], f"{t.name} {qtype}: relative error {err}"


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_dequantize_k_quants(tmp_path, qtype):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    raw = {"a.weight": random_k_blocks(16, 512, qtype, rng), "b.weight": random_k_blocks(3, 256, qtype, rng)}
    path = write_gguf(tmp_path / f"{qtype}.gguf", {n: (r, qtype) for n, r in raw.items()})
    for t in gguf.GGUFReader(str(path)).tensors:
        got = dequantize_gguf_tensor(t)
        rows = raw[t.name].shape[0]
        cols = raw[t.name].shape[1] // gguf.GGML_QUANT_SIZES[QT[qtype]][1] * 256
        assert tuple(got.shape) == (rows, cols)
        ref = reference(raw[t.name], qtype, (rows, cols))
        assert torch.isfinite(ref).all() and ref.abs().max() > 0
        assert torch.equal(got, ref)


@pytest.mark.parametrize("qtype", ("IQ4_NL", "TQ1_0"))
def test_unsupported_type_raises(tmp_path, qtype):
    block, nbytes = gguf.GGML_QUANT_SIZES[QT[qtype]]
    raw = np.random.default_rng(0).integers(0, 256, size=(4, 256 // block * nbytes), dtype=np.uint8)
    path = write_gguf(tmp_path / "bad.gguf", {"blk.0.attn_v.weight": (raw, qtype)})
    (t,) = gguf.GGUFReader(str(path)).tensors
    with pytest.raises(ValueError, match=qtype) as e:
        dequantize_gguf_tensor(t)
    assert "blk.0.attn_v.weight" in str(e.value)


# ---- q/k permutation ---------------------------------------------------------------------------
@pytest.mark.parametrize(("n_head", "head_dim", "cols"), [(4, 16, 8), (3, 64, 5), (1, 2, 3), (9, 64, 0)])
def test_unpermute_qk_inverts_llama_cpp(n_head, head_dim, cols):
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)  # cols 0: a bias vector
    w = torch.randn(shape)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head))
    assert not torch.equal(permuted, w) or head_dim == 2
    assert torch.equal(unpermute_qk(permuted, n_head), w)


def test_bundled_qk_are_unpermuted(bundled_path):
    reader = gguf.GGUFReader(bundled_path)
    cfg = loader.gguf_config(reader)
    wanted = {"blk.0.attn_q.weight": cfg.num_heads, "blk.0.attn_k.weight": cfg.num_kv_heads}
    # iter_gguf_tensors dequantizes everything it meets: give it just the tensors under test.
    reader.tensors = [t for t in reader.tensors if t.name in wanted]
    got = dict(iter_gguf_tensors(reader, cfg))
    for t in reader.tensors:
        ref = reference(t.data, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))
        hf_name = loader.gguf_to_hf_name(t.name)
        assert torch.equal(got[hf_name], unpermute_qk(ref, wanted[t.name]))
        assert torch.equal(torch.from_numpy(llama_cpp_permute(got[hf_name].numpy(), wanted[t.name])), ref)


# ---- whole tiny GGUF models --------------------------------------------------------------------
def _tiny_hf(tie: bool, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.08, tie_word_embeddings=tie)
    hf = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf


_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *mid, leaf = hf_name.split(".")
    return f"blk.{layer}.{_HF_TO_GGUF['.'.join(mid)]}.{leaf}"


def _tiny_gguf(path: Path, hf, types: dict[str, str] | None = None) -> dict[str, tuple[np.ndarray, str]]:
    """Write `hf` as llama.cpp would (permuted q/k, GGUF names); types: GGUF name part → type.
    Returns what was written."""
    c = hf.config
    tensors = {}
    rng = np.random.default_rng(1)
    for hf_name, p in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name)
        w = p.detach().numpy().astype(np.float32)
        if ".attn_q." in name:
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif ".attn_k." in name:
            w = llama_cpp_permute(w, c.num_key_value_heads)
        qtype = "F32" if w.ndim == 1 else next((t for k, t in (types or {}).items() if k in name), "F32")
        if qtype in K_QUANTS:
            tensors[name] = (random_k_blocks(w.shape[0], w.shape[1], qtype, rng), qtype)
        else:
            tensors[name] = (encode(w, qtype), qtype)
    meta = {"llama.block_count": c.num_hidden_layers, "llama.context_length": c.max_position_embeddings,
            "llama.embedding_length": c.hidden_size, "llama.feed_forward_length": c.intermediate_size,
            "llama.attention.head_count": c.num_attention_heads,
            "llama.attention.head_count_kv": c.num_key_value_heads,
            "llama.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
            "llama.rope.freq_base": float(c.rope_parameters["rope_theta"]), "llama.vocab_size": c.vocab_size}
    write_gguf(path, tensors, meta=meta)
    return tensors


@pytest.fixture
def uncached_gguf(monkeypatch):
    """Load GGUFs without evicting the bundled model's dequantized weights from the loader's cache."""
    monkeypatch.setattr(loader, "_dequantized_gguf", loader._dequantized_gguf.__wrapped__)


@pytest.mark.parametrize("tie", [False, True])
def test_f32_gguf_model_matches_transformers(tmp_path, uncached_gguf, tie):
    from pagedserve.attention import AttentionMetadata, get_backend
    from pagedserve.worker.kv_cache import allocate_kv_cache

    hf = _tiny_hf(tie)
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path, hf)
    lm = loader.load_model(str(path), "float32")
    cfg = lm.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 2, 4, 2)
    assert cfg.head_dim == 16
    assert cfg.tie_word_embeddings == tie and cfg.vocab_size == 256
    ids = [random.Random(2).randrange(256) for _ in range(13)]
    bs, table = 4, [5, 1, 7, 2]
    slots = [table[i // bs] * bs + i % bs for i in range(len(ids))]
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor([table]), torch.tensor([len(ids)]),
                             torch.tensor([0, len(ids)]), [len(ids)], [len(ids)], bs)
    kv = allocate_kv_cache(cfg, 8, bs, torch.float32)
    with torch.inference_mode():
        got = lm.model(torch.tensor(ids), torch.arange(len(ids)), kv, get_backend("batched"), meta)
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.abs().max() > 0.5
    assert (got - ref).abs().max().item() <= 1e-4


def test_quantized_gguf_model_loads_reference_weights(tmp_path, uncached_gguf):
    """A tiny model with every supported type somewhere: each loaded weight equals the reference
    dequantization (q/k un-permuted), both through iter_gguf_tensors and in load_model's fused params."""
    hf = _tiny_hf(tie=False, hidden=256)
    types = {"token_embd": "Q8_0", "blk.0.attn_q": "Q4_K", "blk.1.attn_q": "Q5_1", "blk.0.attn_k": "Q6_K",
             "blk.1.attn_k": "Q4_1", "blk.0.attn_v": "Q4_0", "blk.1.attn_v": "Q3_K", "attn_output": "Q5_0",
             "blk.0.ffn_gate": "Q2_K", "blk.1.ffn_gate": "BF16", "ffn_up": "Q5_K", "ffn_down": "F16",
             "output.weight": "Q8_0"}
    path = tmp_path / "mixed.gguf"
    written = _tiny_gguf(path, hf, types)
    assert {t for _, t in written.values()} >= set(QUANTIZABLE) | set(K_QUANTS)
    reader = gguf.GGUFReader(str(path))
    cfg = loader.gguf_config(reader)
    expected = {}
    for name, (data, qtype) in written.items():
        shape = tuple(int(d) for d in reversed(next(t for t in reader.tensors if t.name == name).shape))
        ref = reference(data, qtype, shape)
        if ".attn_q." in name:
            ref = unpermute_qk(ref, cfg.num_heads)
        elif ".attn_k." in name:
            ref = unpermute_qk(ref, cfg.num_kv_heads)
        expected[loader.gguf_to_hf_name(name).removeprefix("model.")] = ref
    got = {name.removeprefix("model."): w for name, w in iter_gguf_tensors(reader, cfg)}
    assert set(got) == set(expected)
    for name, w in got.items():
        assert torch.equal(w, expected[name]), name

    params = dict(loader.load_model(str(path), "float32").model.named_parameters())
    for i in range(2):
        pre = f"layers.{i}."
        qkv = torch.cat([expected[pre + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(params[pre + "self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([expected[pre + "mlp.gate_proj.weight"], expected[pre + "mlp.up_proj.weight"]])
        assert torch.equal(params[pre + "mlp.gate_up_proj.weight"], gate_up)
        assert torch.equal(params[pre + "mlp.down_proj.weight"], expected[pre + "mlp.down_proj.weight"])
    assert torch.equal(params["embed_tokens.weight"], expected["embed_tokens.weight"])
    assert torch.equal(params["lm_head.weight"], expected["lm_head.weight"])


def test_unsupported_type_in_model_raises(tmp_path, uncached_gguf):
    hf = _tiny_hf(tie=True)
    path = tmp_path / "iq.gguf"
    tensors = _tiny_gguf(path, hf)
    block, nbytes = gguf.GGML_QUANT_SIZES[QT.IQ4_NL]
    rows, cols = hf.config.num_key_value_heads * 16, hf.config.hidden_size
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // block * nbytes), dtype=np.uint8)
    tensors["blk.1.attn_v.weight"] = (raw, "IQ4_NL")
    c = hf.config
    write_gguf(path, tensors, meta={"llama.block_count": 2, "llama.embedding_length": c.hidden_size,
                                    "llama.feed_forward_length": c.intermediate_size,
                                    "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
                                    "llama.vocab_size": 256})
    with pytest.raises(ValueError, match="IQ4_NL"):
        loader.load_model(str(path), "float32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_stack_takes_many_sequences_over_gguf_blocks(tmp_path, uncached_gguf, dtype):
    """Every layer matmul of a GGUF model read in place runs one route at every row count (the blocks' kernels;
    bf16 on AVX512-BF16 CPUs), so decode steps of more sequences than GEMV_MAX_ROWS run in DecodeStack as well,
    with the bits of the layer-by-layer path (its fused SwiGLU included); also a step where only some rows sample
    (the stack applies the final norm itself only when every row does)."""
    from test_model_vs_hf import PagedSequences

    from pagedserve.kernels import CpuKernels
    from pagedserve.model.matmul import GEMV_MAX_ROWS

    hf = _tiny_hf(tie=False, hidden=128)
    path = tmp_path / "q.gguf"
    _tiny_gguf(path, hf, {"token_embd": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1",
                          "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_0",
                          "output.weight": "Q8_0"})
    kernels = CpuKernels.build()
    lm = loader.load_model(str(path), dtype, kernels=kernels)
    lm.model.setup_matmuls(kernels, pack=False, batch_hint=8)
    assert lm.model._stack_any_rows
    n = GEMV_MAX_ROWS + 3
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 20))] for _ in range(n)]
    runs = []
    for use_stack in (True, False):
        run = PagedSequences(lm, "fused", n, dtype=dtype, seed=6, kernels=kernels.replace(decode_stack=use_stack))
        steps = [run.step(prompts)]
        for _ in range(5):
            steps.append(run.step([[t] for t in steps[-1].argmax(-1).tolist()]))
        some = run.step([[t] for t in steps[-1].argmax(-1).tolist()], rows=[0, 2, n - 1])
        assert some.shape == (3, 256)
        runs.append((torch.stack(steps), some))
        assert (lm.model._stack is not None) == use_stack
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


def test_bf16_q4_blocks_are_regrouped_lane_local_with_the_same_bits(tmp_path, uncached_gguf):
    """A bf16 model's Q4_0 / Q4_1 layer weights, which quant_linear_bf16 reads at every row count, are regrouped at
    setup into the lane-local packing (quant_lanes); other types, the int8 route's weights and the LM head (whose
    blocks a tied embedding reads) keep quant_pack's. Prefill and decode steps (the stack and layer by layer) give
    the bits of the same model without it, and a setup without it restores the packing byte for byte."""
    from test_model_vs_hf import PagedSequences

    from pagedserve.kernels import CpuKernels
    from pagedserve.model.matmul import Route

    kernels = CpuKernels.build()
    if not kernels.quant_bf16 or kernels.lanes_type(int(QT.Q4_1)) is None:
        pytest.skip("the lane-local packing needs AVX512-BF16 and VBMI")
    hf = _tiny_hf(tie=True, hidden=128)
    path = tmp_path / "q.gguf"
    _tiny_gguf(path, hf, {"token_embd": "Q4_1", "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1",
                          "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_0"})
    lm = loader.load_model(str(path), torch.bfloat16, kernels=kernels)
    lanes = {int(QT.Q4_0): kernels.lanes_type(int(QT.Q4_0)), int(QT.Q4_1): kernels.lanes_type(int(QT.Q4_1))}

    def setup(k):
        routes = lm.model.setup_matmuls(k, pack=False, batch_hint=8)
        parts = [p for r in routes if not r.float32_out for p in r.quant]
        return parts, [p.type_id for p in parts], [p.packed[0].clone() for p in parts]

    parts, plain_types, plain_bytes = setup(kernels.replace(quant_lanes=False))
    assert set(plain_types) == {int(QT.Q4_0), int(QT.Q4_1), int(QT.Q5_0)}
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(6, 20))] for _ in range(6)]
    feed = [[rng.randrange(256) for _ in prompts] for _ in range(4)]

    def decode(k, use_stack=True):
        run = PagedSequences(lm, "fused", len(prompts), dtype=torch.bfloat16, seed=8,
                             kernels=k.replace(decode_stack=use_stack))
        steps = [run.step(prompts)]
        for fed in feed:
            steps.append(run.step([[t] for t in fed]))
        return torch.cat(steps)

    plain = decode(kernels.replace(quant_lanes=False))
    _, types, regrouped = setup(kernels)
    assert types == [lanes.get(t, t) for t in plain_types]
    assert lm.model.embed_quant.type_id == int(QT.Q4_1)  # the tied head and the embedding: quant_pack's
    assert lm.model._head_routes.few_rows == Route.QUANT_BF16 and lm.model._head_routes.quant[0].type_id == int(QT.Q4_1)
    assert any(not torch.equal(a, b) for a, b in zip(regrouped, plain_bytes, strict=True))
    assert torch.equal(decode(kernels), plain)
    assert torch.equal(decode(kernels, use_stack=False), plain)
    _, types, restored = setup(kernels.replace(quant_lanes=False))
    assert types == plain_types
    assert all(torch.equal(a, b) for a, b in zip(restored, plain_bytes, strict=True))
    if kernels.ext.has_quant_i8():  # the int8 route reads quant_pack's packing at a few rows
        k8 = CpuKernels.build(int8_activations=True)
        _, types, _ = setup(k8)
        assert types == plain_types


@pytest.mark.parametrize("arch", ["native", "x86-64-v3"])  # x86-64-v3: the AVX2 int8 kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_activations_take_the_decode_matmuls_only(tmp_path, uncached_gguf, dtype, arch):
    """int8_activations (opt-in): the decode-sized matmuls over Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks quantize
    their activations (route QUANT_I8), prefill-sized ones keep the model's route (other block types too:
    test_matmul_routes). DecodeStack runs the route
    with the layer-by-layer path's bits; the logits stay within a small distance of the unquantized route's (what
    quantizing activations to 8 bits costs) but are not its bits."""
    from test_model_vs_hf import PagedSequences

    from pagedserve.kernels import CpuKernels
    from pagedserve.model.matmul import GEMV_MAX_ROWS, Route

    kernels = CpuKernels.build(arch, int8_activations=True)
    if not kernels.quant_i8:
        pytest.skip("the int8 route needs AVX2")
    hf = _tiny_hf(tie=False, hidden=128)
    path = tmp_path / "q.gguf"
    _tiny_gguf(path, hf, {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q5_0",
                          "attn_output": "Q4_0", "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "ffn_down": "Q4_1",
                          "output.weight": "Q8_0"})
    lm = loader.load_model(str(path), dtype, kernels=kernels)
    routes = lm.model.setup_matmuls(kernels, pack=False, batch_hint=8)
    plain = Route.QUANT_BF16 if dtype == torch.bfloat16 and kernels.quant_bf16 else Route.QUANT
    by_type = {r.quant[0].type_id: r for r in routes}
    for type_id in (2, 3, 6, 7, 8):  # Q4_0 (o), Q4_1 (down), Q5_0 (qkv), Q5_1 (gate_up), Q8_0 (the head)
        assert (by_type[type_id].few_rows, by_type[type_id].many_rows) == (Route.QUANT_I8, plain)
    assert not lm.model._stack_any_rows  # two routes by row count: the stack takes a few sequences only
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    feed = [[rng.randrange(256) for _ in prompts] for _ in range(4)]

    def decode(k, use_stack=True):
        lm.model.setup_matmuls(k, pack=False, batch_hint=8)
        run = PagedSequences(lm, "fused", len(prompts), dtype=dtype, seed=8, kernels=k.replace(decode_stack=use_stack))
        steps = [run.step(prompts)]
        for fed in feed:  # the same tokens for every run (their own greedy picks may part)
            steps.append(run.step([[t] for t in fed]))
        assert (lm.model._stack is not None) == use_stack
        return torch.stack(steps).float()

    stacked, layered = decode(kernels), decode(kernels, use_stack=False)
    assert torch.equal(stacked, layered)
    plain_run = decode(kernels.replace(quant_i8=False))
    # Every step's head has a few rows (the prefill step's last positions too): each step moves a little.
    assert len(prompts) <= GEMV_MAX_ROWS
    for step, (a, b) in enumerate(zip(stacked, plain_run, strict=True)):
        diff = (a - b).abs().max().item()
        assert 0 < diff <= 0.05 * b.abs().max().item(), (step, diff)
