"""The executor: how the engine runs a step on its worker(s), whatever their number (vLLM's seam).

The engine core hands every step (a SchedulerOutput and its SamplingMetadata) to `Executor.execute` and
gets the sampled tokens back; it never sees how many processes computed them.

- UniProcExecutor (the default): the one ModelRunner in the engine's own process, called directly.
- MultiprocExecutor (tensor_parallel_size > 1, executor/multiproc.py): rank 0 is the engine's process;
  it prepares the step's flat inputs, broadcasts them to the other ranks over torch.distributed, and every
  rank runs its shard of the model; rank 0 samples from the gathered logits.

Data parallelism is a level above: several engines (each with its own executor) behind the server
(engine/data_parallel.py).
"""

from __future__ import annotations

from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.worker.model_runner import ModelRunner


class Executor:
    """Runs steps on the workers. `runner` is rank 0's (the engine's own) ModelRunner."""

    runner: ModelRunner
    tensor_parallel_size = 1

    def execute(self, out: SchedulerOutput, sampling: SamplingMetadata | None):
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""

    def check_health(self) -> str | None:
        """None while every worker is alive; else what is wrong."""
        return None


class UniProcExecutor(Executor):
    """The one runner, in this process: a direct call, nothing in between."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, out: SchedulerOutput, sampling: SamplingMetadata | None):
        return self.runner.execute(out, sampling)
