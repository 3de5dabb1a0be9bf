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
