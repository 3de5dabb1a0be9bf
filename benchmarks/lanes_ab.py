"""The bf16 route's two packings of Q4_0 / Q4_1 blocks (quant_pack's, and the lane-local one the model regroups them
into at load: EngineConfig.quant_lanes) on every layer matmul of one W2 decode step (1 row; the bundled model's 120
layer matmuls, 66 MB of blocks), called in sequence as a step streams them, the two packings alternating in one
process (each its own copy of the blocks). Prints ms per step (min and median) and the ratio per repetition.

    python benchmarks/lanes_ab.py [--reps 7] [--model PATH] [--hot]

With --hot, each matmul is instead called 30 times in a row (its blocks in cache): the kernels' compute alone.
Needs a build with the lane-local packing (AVX512-BF16 and VBMI).
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
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", default=None)
    ap.add_argument("--hot", action="store_true")
    args = ap.parse_args()
    llm = LLM(model=args.model)
    k = llm.engine.runner.kernels
    if k is None or not k.quant_bf16 or k.ext.quant_lanes_type(int(gguf.GGMLQuantizationType.Q4_1)) < 0:
        raise SystemExit("needs the bf16 route (AVX512-BF16) with the lane-local packing (VBMI)")

    calls: dict[str, list] = {"quant_pack": [], "lane-local": []}
    for r in llm.engine.runner.model.matmul_routes():
        if not r.quant or r.float32_out:
            continue
        for p in r.quant:
            ggml = k.ggml_type(p.type_id)
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml)]
            planes = [t.clone() for t in p.packed]
            if p.type_id != ggml:
                k.relayout(planes, p.type_id, ggml)
            lanes_type = k.ext.quant_lanes_type(ggml)
            lanes = [t.clone() for t in planes]
            if lanes_type >= 0:
                k.relayout(lanes, ggml, lanes_type)
            kk = planes[0].shape[1] // (16 * block_bytes) * block_size
            calls["quant_pack"].append((planes, ggml, p.n, kk))
            calls["lane-local"].append((lanes, lanes_type if lanes_type >= 0 else ggml, p.n, kk))
    nbytes = sum(c[0][0].numel() for c in calls["quant_pack"])
    print(f"{len(calls['quant_pack'])} matmuls, {nbytes / 1e6:.1f} MB of blocks, {torch.get_num_threads()} threads")
    fn = k.ext.quant_linear_bf16
    xs = {kk: torch.randn(1, kk).bfloat16() for *_, kk in calls["quant_pack"]}

    def step(cs) -> None:
        for packed, t, n, kk in cs:
            fn(xs[kk], packed, t, n, kk, None, torch.bfloat16)

    times = collections.defaultdict(list)
    for _ in range(args.reps):
        for name, cs in calls.items():
            if args.hot:
                total = 0.0
                for c in cs:
                    for _ in range(3):
                        step([c])
                    t0 = time.perf_counter()
                    for _ in range(30):
                        step([c])
                    total += (time.perf_counter() - t0) / 30
                times[name].append(total)
                continue
            for _ in range(2):
                step(cs)
            t0 = time.perf_counter()
            for _ in range(10):
                step(cs)
            times[name].append((time.perf_counter() - t0) / 10)
    for name, ts in times.items():
        print(f"{name}: {min(ts) * 1e3:.3f} ms (median {statistics.median(ts) * 1e3:.3f}) per step")
    ratios = [a / b for a, b in zip(times["lane-local"], times["quant_pack"], strict=True)]
    print("lane-local / quant_pack per repetition:", " ".join(f"{r:.3f}" for r in ratios),
          f"(median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
