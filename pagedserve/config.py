"""EngineConfig: every knob of the engine in one validated dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

DEFAULT_KV_CACHE_FRACTION = 0.2  # of the memory available at start-up...
DEFAULT_KV_CACHE_MAX_GB = 2.0  # ...but never more than this


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length
    num_kv_blocks: int | None = None  # exact number of KV blocks (wins over kv_cache_memory_gb)
    kv_cache_memory_gb: float | None = None  # default: see default_kv_cache_bytes()
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "batched"  # batched | torch_ref
    num_threads: int | None = None  # torch threads; default: the cores this process may use
    keep_block_tables: bool = False  # record every step's block tables (trace / explain / dashboard)
    max_step_records: int = 10_000  # step records kept (oldest dropped first)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.max_step_records, int) or self.max_step_records < 0:
            raise ValueError(f"max_step_records: must be an integer >= 0, got {self.max_step_records!r}")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb: must be > 0, got {self.kv_cache_memory_gb!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "fp32", "bf16"):
            raise ValueError(f"dtype: must be auto, float32 or bfloat16, got {self.dtype!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def default_kv_cache_bytes() -> int:
    """A bounded share of free RAM: 20% of what is available, at most 2 GiB."""
    return int(min(available_memory_bytes() * DEFAULT_KV_CACHE_FRACTION, DEFAULT_KV_CACHE_MAX_GB * 1024**3))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
