"""Decode attention of a W1-like step (128 sequences, 9 query / 3 kv heads, head_dim 64, bf16 cache) on one or two
builds of the C++ extension in ONE process, alternating, with 30 layers' caches so that K/V come from memory as in
the engine (a layer's K and V: 18.9 MB at 192 keys), over consecutive, engine-like (W1's: runs of 8 blocks, then
blocks B apart) and randomly placed cache blocks.

    python benchmarks/decode_attention_ab.py A.so [B.so] [--seqs 128] [--keys 192] [--layers 30] [--reps 7]
        [--heads 9 --kv-heads 3 --head-dim 64] [--no-amx] [--huge-pages] [--dtype bfloat16|float32]

A.so / B.so: extension builds (see benchmarks/ab_builds.py for where they are). With two builds the first
output's largest difference between them is printed as well. Prints ms per layer (median and min of the reps).
--layers 1 --seqs 8 keeps everything in the caches: the kernel's compute alone. Gemma 3 270M's shape: --heads 4
--kv-heads 1 --head-dim 256. --no-amx: the AVX512-BF16 scores on an AMX CPU (set_amx(False) in every build).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch


def load_build(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--keys", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--no-amx", action="store_true")
    ap.add_argument("--huge-pages", action="store_true", help="each layer's K and V in memory backed by 2 MB pages "
                    "(as the engine's --huge-pages)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the cache's and the queries' dtype (float32: what an AVX2-only CPU runs by default)")
    args = ap.parse_args()
    torch.manual_seed(0)
    mods = [load_build(p) for p in args.builds]
    if args.no_amx:
        for m in mods:
            m.set_amx(False)
    B, S, H, KVH, D, BS, L = args.seqs, args.keys, args.heads, args.kv_heads, args.head_dim, 16, args.layers
    nb = (S + BS - 1) // BS
    # One allocation for every layer's K and V, as separate tensors of the engine's shape.
    dt = getattr(torch, args.dtype)
    big = torch.randn(2 * L, B * nb, BS, KVH, D).to(dt)
    caches = [(big[2 * i], big[2 * i + 1]) for i in range(L)]
    if args.huge_pages:
        from pagedserve.kernels import huge_pages

        caches = [tuple(huge_pages.zeros(t.shape, t.dtype).copy_(t) for t in kv) for kv in caches]
        del big
    # "engine": as W1's block tables are in the engine (a fresh pool, blocks handed out in order): each sequence's
    # prompt blocks (128 keys: 8) one after another, the blocks its decode steps added (all sequences cross a block
    # boundary in the same step) B apart.
    pb = min(nb, 8)
    engine = [[b * pb + j for j in range(pb)] + [B * pb + j * B + b for j in range(nb - pb)] for b in range(B)]
    tables = {"consecutive": torch.arange(B * nb, dtype=torch.int64).view(B, nb).contiguous(),
              "engine": torch.tensor(engine, dtype=torch.int64),
              "random": torch.randperm(B * nb).view(B, nb).contiguous()}
    seq_lens = torch.full((B,), S, dtype=torch.int64)
    q = torch.randn(B, H, D).to(dt)
    rows = torch.empty(0, dtype=torch.int64)
    outs = [torch.empty_like(q) for _ in mods]
    for m, o in zip(mods, outs, strict=True):
        m.paged_decode_attention(q, caches[0][0], caches[0][1], tables["random"], seq_lens, rows, o, D ** -0.5)
    if len(mods) > 1:
        print(f"largest difference between the builds: {(outs[0].float() - outs[1].float()).abs().max().item():.3g}")
    for name, table in tables.items():
        res: list[list[float]] = [[] for _ in mods]
        for rep in range(args.reps):
            order = range(len(mods)) if rep % 2 == 0 else reversed(range(len(mods)))
            for i in order:
                t = time.perf_counter()
                for k, v in caches:
                    mods[i].paged_decode_attention(q, k, v, table, seq_lens, rows, outs[i], D ** -0.5)
                res[i].append((time.perf_counter() - t) / L * 1e3)
        print(f"{name:12s}" + "  ".join(f"build {i}: {statistics.median(r):.3f} ms (min {min(r):.3f})"
                                        for i, r in enumerate(res)))


if __name__ == "__main__":
    main()
