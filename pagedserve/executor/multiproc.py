"""Tensor-parallel ranks as processes over torch.distributed (gloo): starting them, loading each rank's
shard, and the step loop of the ranks other than 0.

Start-up, every rank alike: join the group; take rank 0's EngineConfig (a rank on another machine knows
nothing else: `pagedserve worker --rank R --tensor-parallel-size N`); load the whole checkpoint and keep
its shard (executor/tensor_parallel.py); take rank 0's number of KV blocks (rank 0 sizes the cache from its
shard's bytes per block: every rank holds the same shapes); allocate its KV cache shard. Then each step:
rank 0 broadcasts the step's prepared inputs (token ids, positions, slot mapping, block tables...: the
only per-step traffic besides the collectives inside the model), every rank runs the model, rank 0
samples. A None broadcast stops the ranks.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from dataclasses import replace

import torch

from pagedserve.config import EngineConfig, usable_cores
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.executor import Executor
from pagedserve.executor.parallel_state import TPGroup, env_init_method, free_port
from pagedserve.executor.tensor_parallel import plan, shard_model
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedserve")


def rank_threads(config: EngineConfig) -> int:
    """Torch threads of one rank: the cores shared among the ranks of this machine."""
    local = config.tp_local_ranks or config.tensor_parallel_size
    return config.num_threads or max(1, usable_cores() // local)


def load_rank(config: EngineConfig, tp: TPGroup):
    """Load the model and keep this rank's shard: (LoadedModel, the shard's ModelConfig). Quantized GGUF
    blocks are widened (shards cut along columns would split blocks)."""
    from pagedserve.model.loader import load_model, resolve_dtype

    loaded = load_model(config.model, resolve_dtype(config.dtype), config.device, config.keep_dequantized_weights,
                        revision=config.revision, kernels=None)
    plan(loaded.config, tp.size)  # a clear error before any slicing
    rank_cfg = shard_model(loaded.model, loaded.config, tp)
    loaded.gguf_blocks = None
    return loaded, rank_cfg


def start_group(config: EngineConfig) -> tuple[TPGroup, list]:
    """From rank 0 (the engine's process): start this machine's other ranks, join the group, send them the
    config. Waits for the ranks on other machines (env://) until the collective timeout."""
    size = config.tensor_parallel_size
    local = config.tp_local_ranks or size
    init = f"tcp://127.0.0.1:{free_port()}" if local == size else env_init_method()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, size, init), name=f"pagedserve-tp{r}", daemon=True)
             for r in range(1, local)]
    for p in procs:
        p.start()
    joined: list = []
    thread = threading.Thread(target=lambda: joined.append(TPGroup.init(0, size, init)), daemon=True)
    thread.start()
    while thread.is_alive():  # a rank that dies before joining must not leave rank 0 waiting forever
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"tensor parallel: rank {procs.index(dead[0]) + 1} exited (code "
                               f"{dead[0].exitcode}) before joining the group; see its log above")
        thread.join(0.1)
    if not joined:
        raise RuntimeError("tensor parallel: rank 0 could not join the process group")
    tp = joined[0]
    torch.set_num_threads(rank_threads(config))
    tp.broadcast(replace(config, tp_local_ranks=None))
    logger.info("tensor parallel: %d ranks (%d on this machine, %s), %d torch threads each",
                size, local, init, rank_threads(config))
    return tp, procs


def worker_main(rank: int, size: int, init_method: str, num_threads: int | None = None) -> None:
    """One rank other than 0: join, load its shard, then run steps until rank 0 says stop."""
    from pagedserve.logging_setup import configure as configure_logging
    from pagedserve.worker.kv_cache import allocate_kv_cache

    configure_logging()
    tp = TPGroup.init(rank, size, init_method)
    try:
        config: EngineConfig = tp.broadcast()
        torch.set_num_threads(num_threads or rank_threads(config))
        loaded, rank_cfg = load_rank(config, tp)
        num_blocks = tp.broadcast()
        dtype = loaded.model.dtype
        kv = allocate_kv_cache(rank_cfg, num_blocks, config.block_size, dtype, config.device, config.huge_pages)
        runner = ModelRunner(loaded.model, kv, config, None)
        tp.broadcast()  # rank 0's runner is ready too: the first step follows
        while (inputs := tp.broadcast()) is not None:
            runner.forward(inputs)
    except Exception:
        logger.exception("tensor-parallel rank %d failed; leaving the group", rank)
        os._exit(1)  # the other ranks' next collective fails: rank 0 reports it
    tp.destroy()


class MultiprocExecutor(Executor):
    """Rank 0 of a tensor-parallel group: broadcasts every step's inputs, runs its own shard, samples."""

    def __init__(self, runner: ModelRunner, tp: TPGroup, procs: list) -> None:
        self.runner, self.tp, self.procs = runner, tp, procs
        self.tensor_parallel_size = tp.size
        self.broken: str | None = None
        tp.broadcast(True)  # every rank is ready

    def execute(self, out: SchedulerOutput, sampling: SamplingMetadata | None):
        if self.broken is not None:
            raise RuntimeError(self.broken)
        inputs = self.runner.prepare_inputs(out)
        try:
            self.tp.broadcast(inputs)
            logits = self.runner.forward(inputs)
        except Exception as e:
            # The ranks no longer agree on where they are in the step: no later step can run.
            self.broken = f"tensor-parallel group failed in a step ({e}); restart the engine"
            raise
        return self.runner.sample(out, sampling, logits)

    def check_health(self) -> str | None:
        dead = [i + 1 for i, p in enumerate(self.procs) if p.exitcode is not None]
        if dead:
            return f"tensor-parallel rank {dead[0]} exited"
        return self.broken

    def shutdown(self) -> None:
        if self.tp is None:
            return
        try:
            if self.broken is None and self.check_health() is None:
                self.tp.broadcast(None)
        except Exception:
            logger.exception("tensor parallel: stopping the ranks failed")
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
        self.tp.destroy()
        self.tp = None
