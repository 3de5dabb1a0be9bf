"""What this CPU is and can do, read once from /proc/cpuinfo (every other module asks here)."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]

    @property
    def has_avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def has_native_bf16(self) -> bool:
        """bf16 math in hardware (AVX512-BF16 or AMX): bf16 matmuls run at full speed."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def has_amx(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def speed_flags(self) -> list[str]:
        """The flags that decide which kernels run (what benchmark results quote with the CPU model)."""
        return [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in self.flags]

    @property
    def flags_text(self) -> str:
        return " ".join(sorted(self.flags))


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not model and line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif not flags and line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
            if model and flags:
                break
    except OSError:
        pass
    return CpuInfo(model or platform.processor(), frozenset(flags.split()))
