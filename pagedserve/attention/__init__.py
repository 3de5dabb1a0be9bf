"""Attention over the paged KV cache: the backend seam (backend.py) and the registry of backends.

Every backend is checked against `torch_ref` (tests/model/test_attention_backends.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata, write_kv
from pagedserve.attention.cpu import BatchedGatherBackend, BatchInvariantBackend
from pagedserve.attention.torch_ref import TorchRefBackend

if TYPE_CHECKING:
    from pagedserve.kernels import CpuKernels

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchRefBackend.name: TorchRefBackend,
    BatchedGatherBackend.name: BatchedGatherBackend,
    BatchInvariantBackend.name: BatchInvariantBackend,
}

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "get_backend", "write_kv"]


# Imported on first use: triton is needed only by the CUDA backend (attention/triton_backend.py).
LAZY_BACKENDS = ("triton",)


def get_backend(name: str, kernels: CpuKernels | None = None) -> AttentionBackend:
    """A backend by name; `kernels` are the C++ CPU kernels it may use (None: PyTorch only)."""
    if name == "triton":
        from pagedserve.attention.triton_backend import TritonBackend

        return TritonBackend(kernels)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r} (choose from "
                         f"{sorted([*BACKENDS, *LAZY_BACKENDS])})")
    return BACKENDS[name](kernels)
