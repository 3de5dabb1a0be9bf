"""Builds (once, cached by torch under ~/.cache/torch_extensions) pagedserve's C++ CPU kernels.

`pagedserve/csrc/`: the paged decode-attention kernel and the fused elementwise ops of a decoder layer.
They are compiled for the CPU they run on (-march=native), so the extension's name carries a hash of
the CPU's flags: a cache built on one CPU is never loaded on another. If there is no compiler, or
PAGEDSERVE_NO_EXTENSION=1, `load()` returns None and the model runs its pure-PyTorch paths.
PAGEDSERVE_CPU_ARCH (e.g. x86-64-v3) builds for that architecture instead of the host's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [_CSRC / f for f in ("attention.cpp", "ops.cpp", "gguf_gemv.cpp", "decode_stack.cpp", "bindings.cpp")]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def extension_name(arch: str) -> str:
    key = hashlib.sha256(f"{arch}|{_cpu_flags()}".encode()).hexdigest()[:10]
    return f"pagedserve_cpu_{key}"


@functools.cache
def load(arch: str | None = None):
    if os.environ.get("PAGEDSERVE_NO_EXTENSION") == "1":
        return None
    arch = arch or os.environ.get("PAGEDSERVE_CPU_ARCH") or "native"
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name=extension_name(arch),
            sources=[str(s) for s in SOURCES],
            extra_include_paths=[str(_CSRC)],
            # -ffast-math lets the softmax's and SiLU's expf use glibc's vector version (libmvec): the
            # scalar exp dominated the kernels. No kernel sees inf/NaN inputs by construction.
            extra_cflags=["-O3", f"-march={arch}", "-fopenmp", "-ffast-math", "-std=c++20"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: stay on the portable path
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch paths", e)
        return None
