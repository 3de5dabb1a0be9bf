"""The Triton attention kernels (the CUDA backend's) equal torch_ref on random mixed batches with shuffled
block tables: decodes, prefill chunks over cached context, fresh prefills, prefix-cache hits, GQA, sliding
windows and soft-capping. Without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1, set in
conftest.py), so CI checks the kernels' logic; on a GPU (tests/gpu) the same checks run natively."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.attention import get_backend  # noqa: E402
from tests.model.test_attention_backends import MIXES, _fresh_meta, random_batch  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def compare(rng: random.Random, kinds, heads, kv_heads, head_dim, block_size, dtype, *, window=None, softcap=None,
            share_prefix=False, device="cpu") -> None:
    """One layer of attention through torch_ref and the Triton backend on the same inputs and caches:
    outputs within the dtype's tolerance, caches written identically."""
    num_blocks = 64
    meta, num_tokens = random_batch(rng, kinds, block_size, num_blocks, share_prefix=share_prefix,
                                    sliding_window=window)
    g = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    # q as the model hands it: a strided view of a fused qkv row
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    outs = []
    for name, dev in (("torch_ref", "cpu"), ("triton", device)):
        m = _fresh_meta(meta)
        for f in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            setattr(m, f, getattr(m, f).to(dev))
        kc, vc = (c.clone().to(dev) for c in caches)
        out = get_backend(name).forward(q.to(dev), k.to(dev), v.to(dev), kc, vc, m, head_dim**-0.5,
                                        softcap=softcap)
        outs.append((out.cpu(), kc.cpu(), vc.cpu()))
    (ref, rk, rv), (out, kc, vc) = outs
    assert out.dtype == dtype and out.shape == (num_tokens, heads, head_dim)
    diff = (ref.float() - out.float()).abs().max().item()
    assert diff <= TOLERANCE[dtype], f"max |diff| {diff} (kinds {kinds}, window {window}, softcap {softcap})"
    assert torch.equal(rk, kc) and torch.equal(rv, vc)  # the K/V write kernel hit the same slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(8, 2, 32, 4), (9, 3, 64, 16), (6, 1, 80, 8)])
def test_mixed_batches_match_reference(dtype, heads, kv_heads, head_dim, block_size):
    """Mixed steps (decodes, chunks over cached context, fresh prefills, shuffled tables): full causal, a
    window of 1 (only the token itself), a window of 7, and prefix blocks shared between sequences."""
    for trial, window in enumerate([None, 1, 7, None]):
        rng = random.Random(f"triton-{heads}-{block_size}-{trial}")
        kinds = list(MIXES["mixed"])
        rng.shuffle(kinds)
        compare(rng, kinds, heads, kv_heads, head_dim, block_size, dtype, window=window, share_prefix=trial >= 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_batches_and_softcap_match_reference(dtype):
    """All-decode steps (the CUDA-graph shape) and Gemma 2's soft-capping with a window."""
    rng = random.Random("triton-decodes")
    compare(rng, MIXES["decodes"], 8, 2, 32, 16, dtype, share_prefix=True)
    compare(rng, ["decode", "chunk", "prefill"], 8, 2, 32, 16, dtype, window=9, softcap=5.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_on_the_gpu(dtype):
    """The same comparisons with the kernels compiled for the GPU (tensors on cuda)."""
    for trial, window in enumerate([None, 1, 7, None]):
        rng = random.Random(f"triton-gpu-{trial}")
        kinds = list(MIXES["mixed"]) * 4
        rng.shuffle(kinds)
        for heads, kv_heads, head_dim, block_size in [(8, 2, 32, 4), (9, 3, 64, 16), (6, 1, 80, 8), (8, 1, 256, 16)]:
            compare(rng, kinds, heads, kv_heads, head_dim, block_size, dtype, window=window,
                    share_prefix=trial >= 2, device="cuda")
        compare(rng, kinds, 8, 2, 32, 16, dtype, window=window, softcap=5.0, device="cuda")
