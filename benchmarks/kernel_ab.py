"""The prefill-sized kernels of SmolLM2-135M on two (or more) builds of the C++ extension in ONE process, alternating:
the bf16 route's matmuls of a layer (gate_up fused with SwiGLU, qkv, o, down; Q4_1 blocks as in the bundled model)
at M rows, and the bf16 prefill row attention of a 2 x 1,024-token W3 step (9 / 3 heads, D 64, random cache blocks).
Checks that the builds give the same bits, then prints each one's median over the rounds of its per-round medians.

    python benchmarks/kernel_ab.py A.so B.so [--rows 2048 128] [--rounds 5]

A.so / B.so: extension builds (see benchmarks/ab_builds.py for where they are).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from test_quant_gemm import random_blocks  # noqa: E402

SHAPES = [("gate_up+silu", 3072, 576, True), ("qkv", 960, 576, False), ("o", 576, 576, False),
          ("down", 576, 1536, False)]


def load_build(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 128])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    mods = [load_build(p) for p in args.builds]
    qt = gguf.GGMLQuantizationType.Q4_1
    g = torch.Generator().manual_seed(0)
    cases = {}  # name -> (fn(module), flops)
    for name, n, k, silu in SHAPES:
        packed = mods[0].quant_pack(torch.from_numpy(random_blocks(qt, n, k, seed=1)), int(qt))
        for m in args.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            def fn(mod, x=x, p=packed, n=n, k=k, silu=silu):
                if silu:
                    return mod.quant_linear_bf16_silu(x, p, int(qt), n, k)
                return mod.quant_linear_bf16(x, p, int(qt), n, k, None, torch.bfloat16)

            cases[f"{name} M={m}"] = (fn, 2 * m * n * k)
    B, L, H, KVH, D, BS = 2, 1024, 9, 3, 64, 16
    nb = L // BS
    kc = torch.randn(B * nb, BS, KVH, D, generator=g).bfloat16()
    vc = torch.randn(B * nb, BS, KVH, D, generator=g).bfloat16()
    bt = torch.randperm(B * nb, generator=g).view(B, nb).contiguous()
    sl = torch.full((B,), L, dtype=torch.int64)
    qsl = torch.arange(0, B * L + 1, L, dtype=torch.int64)
    q = torch.randn(B * L, H, D, generator=g).bfloat16()
    def attention(mod):
        return mod.paged_attention_rows(q, kc, vc, bt, sl, qsl, D ** -0.5)

    cases["prefill attention 2x1024"] = (attention, B * H * L * (L + 1) / 2 * D * 4)
    for name, (fn, _) in cases.items():
        outs = [fn(mod) for mod in mods]
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        print(f"{name}: {'same bits' if same else 'BITS DIFFER'} across the builds")
    res: dict[tuple[str, int], list[float]] = {}
    for rnd in range(args.rounds):
        order = list(range(len(mods))) if rnd % 2 == 0 else list(reversed(range(len(mods))))
        for name, (fn, _) in cases.items():
            for i in order:
                res.setdefault((name, i), []).append(timed(lambda fn=fn, mod=mods[i]: fn(mod), 9))
    for name, (_, flops) in cases.items():
        line = []
        for i, path in enumerate(args.builds):
            t = statistics.median(res[(name, i)])
            line.append(f"{Path(path).stem}: {t * 1e3:.3f} ms ({flops / t / 1e9:.0f} GFLOP/s)")
        print(f"{name:26s} " + "  ".join(line))


if __name__ == "__main__":
    main()
