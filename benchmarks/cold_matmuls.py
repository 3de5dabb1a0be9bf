"""A W1 decode step's layer matmuls (bf16 route, Q4_1 blocks as in the bundled model, M rows) timed warm and after
what a decode step does between them (its attention streams ~19 MB of K/V through the caches), with parts of the
state warmed back, to see what a matmul pays for starting cold:

    python benchmarks/cold_matmuls.py [--rows 128] [--reps 15]

Cases, each the median of the reps (one process, cases interleaved):
  warm            the same call twice, the second timed
  cold            a 64 MB read first (every cache level flushed), then x rewritten (as the op before would)
  cold, w warm    ... and the matmul's blocks read
  cold, other w   ... and the same matmul once on OTHER blocks (code, scratch, output chunk and threads warm)
  cold, same code ... and the same kernel on 8 rows of another shape (its code warm, little else)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from test_quant_gemm import random_blocks  # noqa: E402

from pagedserve.kernels.build import load_extension  # noqa: E402

SHAPES = [("gate_up+silu", 3072, 576, True), ("qkv", 960, 576, False), ("o", 576, 576, False),
          ("down", 576, 1536, False)]


def measure(ext, name: str, n: int, k: int, silu: bool, rows: int, reps: int, flush, same_code) -> None:
    qt = gguf.GGMLQuantizationType.Q4_1
    packed, other = (ext.quant_pack(torch.from_numpy(random_blocks(qt, n, k, seed=s)), int(qt)) for s in (1, 2))
    x, src = torch.randn(rows, k).bfloat16(), torch.randn(rows, k).bfloat16()

    def call(w):
        if silu:
            return ext.quant_linear_bf16_silu(x, w, int(qt), n, k)
        return ext.quant_linear_bf16(x, w, int(qt), n, k, None, torch.bfloat16)

    def cold(then=None):
        flush.sum()
        x.copy_(src)
        if then is not None:
            then()

    cases = {"warm": lambda: call(packed), "cold": cold,
             "cold, w warm": lambda: cold(lambda: [t.sum() for t in packed]),
             "cold, other w": lambda: cold(lambda: call(other)), "cold, same code": lambda: cold(same_code)}
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(reps):
        for c, before in cases.items():
            before()
            t = time.perf_counter()
            call(packed)
            times[c].append(time.perf_counter() - t)
    cells = "  ".join(f"{c} {statistics.median(v) * 1e3:.3f}" for c, v in times.items())
    print(f"M={rows} {name:13s} {cells}  (ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ext = load_extension()
    qt = gguf.GGMLQuantizationType.Q4_1
    flush = torch.ones(64 << 20, dtype=torch.uint8)
    other_shape = ext.quant_pack(torch.from_numpy(random_blocks(qt, 64, 1536, seed=3)), int(qt))
    x8 = torch.randn(8, 1536).bfloat16()

    def same_code():
        ext.quant_linear_bf16(x8, other_shape, int(qt), 64, 1536, None, torch.bfloat16)

    for name, n, k, silu in SHAPES:
        measure(ext, name, n, k, silu, args.rows, args.reps, flush, same_code)


if __name__ == "__main__":
    main()
