"""The tensor-parallel process group: torch.distributed (gloo on CPU), its rank and size, and the three
collectives a sharded model needs: all-reduce (after the attention's and the MLP's row-parallel matmul),
all-gather (the vocabulary-parallel LM head's logits) and rank 0's broadcast of each step's inputs.

Initialisation: every rank on this machine (the default) meets at tcp://127.0.0.1:<free port>; ranks on
several machines meet through torch.distributed's env:// (MASTER_ADDR and MASTER_PORT, the same on every
machine; rank 0 is the engine's own process).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.envs import ENV, distributed_rendezvous

# A collective that waits longer than this is a rank gone (a crash, a lost machine): it raises instead of
# hanging the engine. Loading a model on a slow rank happens before the first collective that has it.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=ENV.tp_timeout_s)  # PAGEDSERVE_TP_TIMEOUT_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_init_method() -> str:
    """env://, checked: torch.distributed reads MASTER_ADDR and MASTER_PORT from the environment."""
    missing = [name for name, value in distributed_rendezvous().items() if not value]
    if missing:
        raise ValueError(f"tp_local_ranks: ranks on other machines meet through env://; set {' and '.join(missing)}"
                         " (the address and a free port of the machine that runs rank 0) on every machine")
    return "env://"


@dataclass
class TPGroup:
    rank: int
    size: int

    @staticmethod
    def init(rank: int, size: int, init_method: str) -> TPGroup:
        backend = "gloo"  # CPU tensors; a CUDA path would use nccl here
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        return TPGroup(rank, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dimension (rank order)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj=None):
        """Rank 0's object (pickled; tensors included) on every rank."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
