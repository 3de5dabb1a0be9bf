"""The per-step cost of tensor parallelism's collectives on this machine: gloo all-reduce of one layer's
output ([tokens, hidden] float32) and rank 0's broadcast of a step's inputs, for 2 and 3 ranks.

    python benchmarks/parallel/allreduce.py [--hidden 576] [--layers 30] [--json out.json]

A step of a model with L layers does 2L + 1 all-reduces (attention and MLP outputs, the embedding), one
all-gather of the logits and one broadcast; the printout multiplies the measured medians out per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = (1, 4, 64, 512, 2048)


def _rank(rank: int, size: int, port: int, hidden: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    out = {}
    for tokens in SHAPES:
        x = torch.randn(tokens, hidden)
        times = []
        for _ in range(60):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        out[tokens] = statistics.median(times[10:]) * 1e6
    inputs = (torch.arange(16), torch.arange(16), torch.zeros(16, 8, dtype=torch.long))
    times = []
    for _ in range(60):
        dist.barrier()
        t = time.perf_counter()
        box = [inputs if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        times.append(time.perf_counter() - t)
    out["broadcast"] = statistics.median(times[10:]) * 1e6
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pagedserve.entrypoints.cli.bench import machine_info
    from pagedserve.executor.parallel_state import free_port

    result = {"hidden": args.hidden, "layers": args.layers, "machine": machine_info(), "ranks": {}}
    ctx = mp.get_context("spawn")
    for size in (2, 3):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, size, port, args.hidden, queue)) for r in range(size)]
        for p in procs:
            p.start()
        us = queue.get(timeout=300)
        for p in procs:
            p.join()
        per_step = {t: (2 * args.layers + 1) * us[t] + us["broadcast"] for t in SHAPES}
        result["ranks"][size] = {"all_reduce_us": {t: us[t] for t in SHAPES}, "broadcast_us": us["broadcast"],
                                 "collectives_ms_per_step": {t: v / 1000 for t, v in per_step.items()}}
        print(f"{size} ranks: broadcast of a step's inputs {us['broadcast']:.0f} us")
        for t in SHAPES:
            print(f"  all-reduce [{t:5d} x {args.hidden}] float32: {us[t]:8.0f} us; x{2 * args.layers + 1} per step "
                  f"+ broadcast = {per_step[t] / 1000:7.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
