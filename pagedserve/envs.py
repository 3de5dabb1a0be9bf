"""Every environment variable pagedserve reads, read once, here.

The compute-path switches only supply the defaults of `EngineConfig` fields (an explicit argument, or
the matching CLI flag, wins): they exist so a benchmark or a debugging session can flip a path without
touching code. Nothing else in the package looks at os.environ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name) == "1"


@dataclass(frozen=True, slots=True)
class Environment:
    # EngineConfig defaults (see config.py for what each switch does)
    use_cpp_kernels: bool  # PAGEDSERVE_NO_EXTENSION=1 -> False
    cpu_arch: str  # PAGEDSERVE_CPU_ARCH, e.g. x86-64-v3 (default: native)
    pack_weights: bool  # PAGEDSERVE_NO_PACK=1 -> False
    bf16_gemv: bool  # PAGEDSERVE_NO_GEMV=1 -> False
    gguf_gemv: bool  # PAGEDSERVE_NO_GGUF_GEMV=1 -> False
    gguf_in_place: bool  # PAGEDSERVE_DEQUANTIZE_GGUF=1 -> False
    decode_stack: bool  # PAGEDSERVE_NO_DECODE_STACK=1 -> False
    amx: bool  # PAGEDSERVE_NO_AMX=1 -> False
    quant_lanes: bool  # PAGEDSERVE_NO_QUANT_LANES=1 -> False
    huge_pages: bool  # PAGEDSERVE_NO_HUGE_PAGES=1 -> False
    int8_activations: bool  # PAGEDSERVE_INT8_ACTIVATIONS=1 -> True
    keep_dequantized_weights: bool  # PAGEDSERVE_KEEP_DEQUANTIZED=1 -> True
    fixed_matmuls: bool | None  # PAGEDSERVE_FIXED_MATMULS=1 -> True, =0 -> False (unset: per CPU)
    batch_invariant: bool  # PAGEDSERVE_BATCH_INVARIANT=1 (or vLLM's VLLM_BATCH_INVARIANT=1) -> True
    # elsewhere
    cache_dir: Path  # PAGEDSERVE_CACHE: converted tokenizers (default ~/.cache/pagedserve)
    api_key: str | None  # PAGEDSERVE_API_KEY: default of `serve --api-key`
    configure_logging: bool  # PAGEDSERVE_CONFIGURE_LOGGING=0 -> False
    logging_level: str  # PAGEDSERVE_LOGGING_LEVEL (default INFO)
    tp_timeout_s: float  # PAGEDSERVE_TP_TIMEOUT_S: a tensor-parallel collective waits this long (default 300)


def read_environment() -> Environment:
    env = os.environ
    return Environment(
        use_cpp_kernels=not _flag("PAGEDSERVE_NO_EXTENSION"),
        cpu_arch=env.get("PAGEDSERVE_CPU_ARCH") or "native",
        pack_weights=not _flag("PAGEDSERVE_NO_PACK"),
        bf16_gemv=not _flag("PAGEDSERVE_NO_GEMV"),
        gguf_gemv=not _flag("PAGEDSERVE_NO_GGUF_GEMV"),
        gguf_in_place=not _flag("PAGEDSERVE_DEQUANTIZE_GGUF"),
        decode_stack=not _flag("PAGEDSERVE_NO_DECODE_STACK"),
        amx=not _flag("PAGEDSERVE_NO_AMX"),
        quant_lanes=not _flag("PAGEDSERVE_NO_QUANT_LANES"),
        huge_pages=not _flag("PAGEDSERVE_NO_HUGE_PAGES"),
        int8_activations=_flag("PAGEDSERVE_INT8_ACTIVATIONS"),
        keep_dequantized_weights=_flag("PAGEDSERVE_KEEP_DEQUANTIZED"),
        fixed_matmuls={"1": True, "0": False}.get(env.get("PAGEDSERVE_FIXED_MATMULS", "")),
        batch_invariant=_flag("PAGEDSERVE_BATCH_INVARIANT") or _flag("VLLM_BATCH_INVARIANT"),
        cache_dir=Path(env.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"),
        api_key=env.get("PAGEDSERVE_API_KEY"),
        configure_logging=env.get("PAGEDSERVE_CONFIGURE_LOGGING", "1") != "0",
        logging_level=env.get("PAGEDSERVE_LOGGING_LEVEL", "INFO").upper(),
        tp_timeout_s=float(env.get("PAGEDSERVE_TP_TIMEOUT_S") or 300),
    )


def distributed_rendezvous() -> dict[str, str | None]:
    """torch.distributed's env:// variables, read when a group forms (not at import: a launcher sets them)."""
    return {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels on the CPU through its interpreter. Triton reads it when
    a kernel module is imported, so this is read then too, not at pagedserve's import."""
    return os.environ.get("TRITON_INTERPRET") == "1"


ENV = read_environment()
