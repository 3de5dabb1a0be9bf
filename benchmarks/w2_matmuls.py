"""Every matmul of one W2 decode step (1 row; the bundled model's 120 layer matmuls and its LM head, 96 MB of GGUF
blocks) called in sequence, as a step streams them, on the bf16 route (quant_linear_bf16: the reference's
numerics) and on the int8-activation route (quant_linear_i8: --int8-activations, llama.cpp's numerics), alternating
in one process. Prints ms per step (min and median of the repetitions) and the weights' read rate.

    python benchmarks/w2_matmuls.py [--reps 5] [--model PATH]

With --hot, each matmul is instead called 50 times in a row (its blocks in cache): the kernels' compute alone.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import gguf
import torch

from pagedserve import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--hot", action="store_true")
    args = ap.parse_args()
    llm = LLM(model=args.model, int8_activations=True)
    runner = llm.engine.runner
    k = runner.kernels
    if k is None or not k.quant_i8 or not k.quant_bf16:
        raise SystemExit("needs the int8 route (AVX512-VNNI + VBMI) and the bf16 one (AVX512-BF16)")

    def k_of(p) -> int:  # a packed row of 16 rows' blocks -> weights per row
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(p.type_id)]
        return p.packed[0].shape[1] // (16 * block_bytes) * block_size

    calls = [(p, k_of(p)) for r in runner.model.matmul_routes() if r.quant for p in r.quant]
    nbytes = sum(p.packed[0].numel() for p, _ in calls)
    print(f"{len(calls)} matmuls, {nbytes / 1e6:.1f} MB of blocks, {torch.get_num_threads()} threads")
    xs = {kk: torch.randn(1, kk).bfloat16() for _, kk in calls}
    routes = {"bf16": k.ext.quant_linear_bf16, "int8": k.ext.quant_linear_i8}

    if args.hot:
        per = collections.defaultdict(lambda: collections.defaultdict(float))
        for name, fn in routes.items():
            for p, kk in calls:
                for _ in range(5):
                    fn(xs[kk], p.packed, p.type_id, p.n, kk, None, torch.bfloat16)
                t = time.perf_counter()
                for _ in range(50):
                    fn(xs[kk], p.packed, p.type_id, p.n, kk, None, torch.bfloat16)
                per[name][(p.type_id, p.n, kk)] += (time.perf_counter() - t) / 50
        for name, shapes in per.items():
            total = sum(shapes.values())
            print(f"{name}: {total * 1e3:.2f} ms per step with each matmul's blocks in cache; "
                  + ", ".join(f"type {t} {n}x{kk} {v * 1e3:.2f}" for (t, n, kk), v in shapes.items()))
        return

    times = collections.defaultdict(list)
    for _ in range(args.reps):
        for name, fn in routes.items():
            for _ in range(2):
                for p, kk in calls:
                    fn(xs[kk], p.packed, p.type_id, p.n, kk, None, torch.bfloat16)
            t = time.perf_counter()
            for _ in range(10):
                for p, kk in calls:
                    fn(xs[kk], p.packed, p.type_id, p.n, kk, None, torch.bfloat16)
            times[name].append((time.perf_counter() - t) / 10)
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name}: {min(ts) * 1e3:.2f} ms (median {med * 1e3:.2f}) per step, {nbytes / med / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
