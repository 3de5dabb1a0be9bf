"""`pagedserve worker`: tensor-parallel ranks on a machine other than rank 0's.

Rank 0 is the engine (`pagedserve serve|generate|bench ... --tensor-parallel-size N --tp-local-ranks K`
starts ranks 0..K-1 on its machine). Every other machine runs the ranks it holds:

    MASTER_ADDR=<rank 0's address> MASTER_PORT=<a free port there> \\
        pagedserve worker --tensor-parallel-size N --rank K [--num-ranks M]

All ranks meet through torch.distributed's env:// initialisation (gloo). The engine's configuration (the
model path included: the same file must exist at that path on every machine) comes from rank 0.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys


def register(sub) -> None:
    p = sub.add_parser("worker", help="tensor-parallel ranks for an engine on another machine (env://)")
    p.add_argument("--tensor-parallel-size", type=int, required=True, help="ranks in the whole group")
    p.add_argument("--rank", type=int, required=True, help="the first rank this machine runs (>= 1)")
    p.add_argument("--num-ranks", type=int, default=1, help="consecutive ranks this machine runs (processes)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per rank (default: this "
                   "machine's cores / num-ranks)")
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from pagedserve.config import usable_cores
    from pagedserve.executor.multiproc import worker_main
    from pagedserve.executor.parallel_state import env_init_method

    size, first, count = args.tensor_parallel_size, args.rank, args.num_ranks
    if size < 2:
        raise ValueError(f"tensor-parallel-size: must be >= 2, got {size}")
    if not 1 <= first or count < 1 or first + count > size:
        raise ValueError(f"rank: ranks {first}..{first + count - 1} are not within 1..{size - 1} (rank 0 is the "
                         "engine's own process)")
    init = env_init_method()
    threads = args.num_threads or max(1, usable_cores() // count)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, size, init, threads), name=f"pagedserve-tp{r}")
             for r in range(first + 1, first + count)]
    for p in procs:
        p.start()
    worker_main(first, size, init, threads)
    for p in procs:
        p.join()
    code = max([0] + [p.exitcode or 0 for p in procs])
    # Leave without the interpreter's teardown: after a clean stop gloo's threads can still abort the process
    # there ("terminate called without an active exception", exit -6; seen once in a full test run).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
