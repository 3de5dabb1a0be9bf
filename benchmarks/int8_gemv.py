"""One decode-sized matmul (1 row of bf16 activations) over random GGUF blocks, bf16 route (quant_linear_bf16) against
the int8-activation route (quant_linear_i8, --int8-activations), each called in a loop with its blocks in cache: the
kernels' compute.

    python benchmarks/int8_gemv.py [TYPE:N:K ...] [--rows M] [--arch x86-64-v3]   # default: the shapes in DEFAULT

--arch x86-64-v3: the portable AVX2 build (an AVX2-only CPU's kernels), where the model's route is float32
(quant_linear over float32 activations) and quant_linear_i8 runs its AVX2 kernels.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from test_quant_gemm import random_blocks  # noqa: E402

from pagedserve.kernels.build import load_extension  # noqa: E402

# Gemma 3 270M's decode matmuls by block type (Q5_0 gate/up, Q4_K o, Q6_K down) and 4,096-square ones of each type.
DEFAULT = ["Q5_0:2048:640", "Q4_K:640:1024", "Q6_K:640:2048", "Q4_1:4096:4096", "Q5_0:4096:4096", "Q5_1:4096:4096",
           "Q4_K:4096:4096", "Q5_K:4096:4096", "Q6_K:4096:4096"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=DEFAULT)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--arch", default="native")
    args = ap.parse_args()
    ext = load_extension(args.arch)
    bf16 = ext.has_quant_bf16()
    plain, dtype = ("quant_linear_bf16", torch.bfloat16) if bf16 else ("quant_linear", torch.float32)
    print(f"{args.arch} build: int8 kernels {'AVX512-VNNI' if ext.has_quant_i8_vnni() else 'AVX2'}, {args.rows} row(s)")
    for spec in args.shapes:
        name, n, k = spec.split(":")
        qt, n, k = gguf.GGMLQuantizationType[name], int(n), int(k)
        packed = ext.quant_pack(torch.from_numpy(random_blocks(qt, n, k, seed=1)), int(qt))
        x = torch.randn(args.rows, k).to(dtype)
        for route in (plain, "quant_linear_i8"):
            fn = getattr(ext, route)
            for _ in range(10):
                fn(x, packed, int(qt), n, k, None, dtype)
            reps = max(10, int(3e8 / packed[0].numel()))
            t = time.perf_counter()
            for _ in range(reps):
                fn(x, packed, int(qt), n, k, None, dtype)
            dt = (time.perf_counter() - t) / reps
            print(f"{name} {n} x {k} {route}: {dt * 1e6:.1f} us, {packed[0].numel() / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
