"""KV-cache arithmetic: bytes per block and capacity planning.

bytes per block = 2 (K and V) × layers × kv_heads × head_dim × block_size × bytes per element
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "float8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: unknown KV dtype {dtype!r} (choose from {sorted(DTYPE_BYTES)})")
    return DTYPE_BYTES[dtype]


def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, elem_bytes: int) -> int:
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size), ("bytes per element", elem_bytes)):
        if value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value}")
    return 2 * layers * kv_heads * head_dim * block_size * elem_bytes


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens (the last one partly filled)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVCapacity:
    block_bytes: int
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, tokens_per_request: int) -> int:
        """Requests of this many tokens (prompt + output) that fit in the cache at once."""
        per_request = blocks_for_tokens(tokens_per_request, self.block_size)
        return self.num_blocks // per_request if per_request else 0


def capacity(block_bytes: int, memory_bytes: float, block_size: int) -> KVCapacity:
    return KVCapacity(block_bytes, int(memory_bytes // block_bytes), block_size)


def human_bytes(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" or float(n).is_integer() else f"{n:.2f} {unit}"


@dataclass(frozen=True)
class GpuMemoryPlan:
    """How a GPU's memory is shared out (vLLM's rule): the engine may use `utilization` of the total; the
    weights, the peak activation memory of a warm-up step at the step budget and what is in use on the
    GPU outside this engine's tensors (the CUDA context, other processes) come first, the KV cache gets
    the rest."""

    total: int
    utilization: float
    weights: int
    peak_activation: int
    other: int

    @property
    def budget(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_cache(self) -> int:
        return self.budget - self.weights - self.peak_activation - self.other

    def describe(self) -> str:
        return (f"{self.utilization:g} of {human_bytes(self.total)} = {human_bytes(self.budget)}: weights "
                f"{human_bytes(self.weights)}, peak activations {human_bytes(self.peak_activation)}, "
                f"{human_bytes(self.other)} in use outside this engine's tensors")

    def num_blocks(self, block_bytes: int) -> int:
        """KV blocks that fit; a ValueError naming gpu_memory_utilization when not one does."""
        n = self.kv_cache // block_bytes if self.kv_cache > 0 else 0
        if n < 1:
            raise ValueError(f"gpu_memory_utilization: {self.describe()} leave no room for a KV block of "
                             f"{human_bytes(block_bytes)}; raise gpu_memory_utilization or lower "
                             "max_num_batched_tokens")
        return int(n)
