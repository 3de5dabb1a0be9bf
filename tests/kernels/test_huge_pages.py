"""kernels/huge_pages.py: the KV cache and the packed weights in 2 MB-aligned mappings advised MADV_HUGEPAGE
(EngineConfig.huge_pages). Whether the OS then backs them with 2 MB pages is its choice (THP mode, free
memory); what pagedserve controls is checked here: the memory is zeroed, aligned, holds the values put in
it, stays alive with its tensors, and an engine gives the same tokens with and without it."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedserve.kernels import huge_pages

needs_madvise = pytest.mark.skipif(not huge_pages.supported(), reason="no MADV_HUGEPAGE (not Linux)")


@needs_madvise
@pytest.mark.parametrize("shape, dtype", [((3, 1 << 20), torch.bfloat16), ((1 << 19,), torch.float32),
                                          ((100, 7, 3000), torch.uint8)])
def test_zeros_from_2_mb_is_zeroed_memory_on_a_2_mb_boundary(shape, dtype):
    t = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % huge_pages.PAGE == 0
    assert not t.any()
    t.view(-1)[-1] = 3  # the whole range is ours: writable to its last element
    ptr = t.data_ptr()
    view = t[..., :1]
    del t
    gc.collect()
    assert view.data_ptr() == ptr and view.reshape(-1)[0] == 0  # the mapping lives while a view does
    untouched = huge_pages.zeros(shape, dtype, touch=False)
    assert not untouched.any()  # an anonymous mapping reads zero before any write


@needs_madvise
def test_huge_pages_are_asked_for_only_where_the_kernel_has_them_free(monkeypatch):
    free = huge_pages.free_pages()
    assert free is None or free >= 0  # this machine's /proc/buddyinfo, read
    page = huge_pages.PAGE
    monkeypatch.setattr(huge_pages, "free_pages", lambda: 5)
    assert huge_pages.enough_free(2 * page) and huge_pages.enough_free(2 * page + 1 - page)
    assert not huge_pages.enough_free(3 * page) and not huge_pages.enough_free(2 * page + 1)
    monkeypatch.setattr(huge_pages, "free_pages", lambda: None)  # cannot say: ask
    assert huge_pages.enough_free(1000 * page)
    monkeypatch.setattr(huge_pages, "free_pages", lambda: 0)  # none free: the memory is the same, 4 KB pages
    t = huge_pages.zeros((3 * page,), torch.uint8)
    assert t.data_ptr() % page == 0 and not t.any()


def test_zeros_under_2_mb_is_an_ordinary_tensor():
    t = huge_pages.zeros((100, 100), torch.float32)
    assert t.shape == (100, 100) and not t.any()
    assert t.untyped_storage().nbytes() == 100 * 100 * 4  # torch's own allocation, not a mapping


@needs_madvise
def test_arena_keeps_copies_side_by_side_and_big_ones_apart():
    arena = huge_pages.Arena(chunk=4 << 20)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1000, 64 * 1024, 3)]
    sources += [torch.randn(300, 77, generator=g).bfloat16(), torch.randn(0, 5), torch.randn(1 << 20, generator=g)]
    copies = [arena.copy(s) for s in sources]
    for s, c in zip(sources, copies, strict=True):
        assert c.shape == s.shape and c.dtype == s.dtype and torch.equal(c, s)
        if s.numel():
            assert c.data_ptr() != s.data_ptr() and c.data_ptr() % huge_pages.Arena.ALIGN == 0
    sources[0].fill_(7)
    assert not torch.equal(copies[0], sources[0])  # a copy, not a view
    small = [c.data_ptr() for c, s in zip(copies, sources, strict=True) if 0 < s.numel() * s.element_size() < (4 << 20)]
    assert max(small) - min(small) < (4 << 20)  # one chunk
    assert copies[-1].data_ptr() % huge_pages.PAGE == 0  # 4 MB: a mapping of its own
    # A chunk that cannot take the next copy: a new chunk, the copies before it intact.
    more = [arena.copy(torch.full((1 << 20,), i, dtype=torch.uint8)) for i in range(5)]
    assert all(bool((m == i).all()) for i, m in enumerate(more))
    assert all(torch.equal(c, s) for c, s in zip(copies[1:], sources[1:], strict=True))
    assert arena.copy(torch.ones(3, device="meta")).device.type == "meta"  # not CPU memory: as it is


@needs_madvise
def test_engine_with_huge_pages_keeps_cache_and_weights_there_and_gives_the_same_tokens():
    from pagedserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):"]
    outs, engines = [], []
    for on in (False, True):
        llm = LLM(huge_pages=on, num_kv_blocks=400)  # 2.4 MB per layer's K (or V)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        engines.append(llm.engine)
    assert outs[0] == outs[1]
    off, on = engines
    assert all(t.data_ptr() % huge_pages.PAGE == 0 for kv in on.kv_caches for t in kv)
    assert sum(t.data_ptr() % huge_pages.PAGE != 0 for kv in off.kv_caches for t in kv) > 0
    quant = [p for r in on.runner.model.matmul_routes() if r.quant for p in r.quant]
    assert quant  # the bundled GGUF's blocks read in place
    ptrs = sorted(t.data_ptr() for p in quant for t in p.packed)
    # Side by side in 32 MB chunks (the ~92 MB of weights in a handful), not scattered over the heap.
    chunks = {ptr // (32 << 20) for ptr in ptrs}
    assert len(chunks) <= 8 and len(ptrs) > 100
