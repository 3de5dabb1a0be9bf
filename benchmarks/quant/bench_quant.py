"""Micro benchmark of the matmuls over GGUF blocks read in place (csrc/quant_gemm.cpp), against the
batch-invariant dense matmul (fixed_linear) over the dequantized float32 weight. Not a test.

Usage: python benchmarks/quant/bench_quant.py [--threads N] [--reps R] [--quick] [--json OUT]

For each type and shape (N x K = output x input features): GEMV (M = 1) as GB/s of weight bytes read
(quant_pack's bytes for quant_linear, N * K * 4 for the dense one) and GEMM (M = 512) as GFLOP/s
(2 M N K / time). Each figure is the best of R runs (the machine may be shared). K-quants need K % 256 == 0,
so their 2048 x 640 shape is 2048 x 768.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from functools import partial

import gguf
import numpy as np
import torch

from pagedserve.entrypoints.cli.roofline import best_of as best
from pagedserve.kernels import CpuKernels

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = k // block_size
    raw = rng.integers(0, 256, size=(n, nb, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, :, off:off + 2] = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(
            n, nb, 2)
    return torch.from_numpy(raw.reshape(n, nb * block_bytes))


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=512, help="M of the GEMM")
    ap.add_argument("--quick", action="store_true", help="skip the 262144 x 640 shape")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = CpuKernels.build()
    assert kernels is not None, "the C++ kernels did not build"
    rng = np.random.default_rng(0)
    cases = []
    for qtype in TYPES:
        kq = gguf.GGML_QUANT_SIZES[qtype][0] == 256
        cases += [(qtype, 2048, 768 if kq else 640), (qtype, 640, 2048)]
    if not args.quick:
        cases.append((Q.Q8_0, 262144, 640))  # an LM head's shape (Gemma-3-270m's vocabulary)
    print(f"# {cpu_model()}, {args.threads} threads, torch {torch.__version__}, best of {args.reps}")
    print(f"{'type':6} {'N x K':>13} | {'GEMV GB/s':>9} {'us':>8} | {'dense GB/s':>10} {'us':>8} | "
          f"{'GEMM GF/s':>9} {'dense GF/s':>10}")
    results = []
    for qtype, n, k in cases:
        raw = random_blocks(qtype, n, k, rng)
        packed = kernels.quant_pack(raw, int(qtype))
        qbytes = sum(t.numel() for t in packed)
        dense = kernels.fixed_pack(torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)))
        x1 = torch.randn(1, k)
        xm = torch.randn(args.rows, k)
        big = n * k > 50_000_000
        reps = max(3, args.reps // 5) if big else args.reps
        t_q1 = best(partial(kernels.quant_linear, x1, packed, int(qtype), n, None, torch.float32), reps)
        t_d1 = best(partial(kernels.fixed_linear, x1, dense, n, None, torch.float32), reps)
        flops = 2 * args.rows * n * k
        if big:  # the GEMM at this shape takes seconds; the GEMV is what this shape is about
            t_qm = t_dm = float("nan")
        else:
            few = max(3, reps // 4)
            t_qm = best(partial(kernels.quant_linear, xm, packed, int(qtype), n, None, torch.float32), few)
            t_dm = best(partial(kernels.fixed_linear, xm, dense, n, None, torch.float32), few)
        row = {"type": qtype.name, "n": n, "k": k, "packed_bytes": qbytes, "raw_bytes": raw.numel(),
               "gemv_us": t_q1 * 1e6, "gemv_gbs": qbytes / t_q1 / 1e9, "dense_gemv_us": t_d1 * 1e6,
               "dense_gemv_gbs": n * k * 4 / t_d1 / 1e9, "gemm_gflops": flops / t_qm / 1e9,
               "dense_gemm_gflops": flops / t_dm / 1e9}
        results.append(row)
        print(f"{qtype.name:6} {f'{n}x{k}':>13} | {row['gemv_gbs']:9.1f} {row['gemv_us']:8.0f} | "
              f"{row['dense_gemv_gbs']:10.1f} {row['dense_gemv_us']:8.0f} | {row['gemm_gflops']:9.1f} "
              f"{row['dense_gemm_gflops']:10.1f}", flush=True)
        del dense, packed, raw
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": args.threads, "rows": args.rows, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
