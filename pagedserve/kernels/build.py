"""Builds (once, cached by torch under ~/.cache/torch_extensions) pagedserve's C++ CPU kernels from csrc/.

They are compiled for the CPU they run on (-march=native by default), so the extension's name carries
a hash of the CPU's flags and of the sources: a build made on one CPU, or from other sources, is never
loaded in place of this one. No compiler (or a failing build) means None: the portable PyTorch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

from pagedserve.kernels.cpu_info import cpu_info

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# The kernel sources, compiled as two translation units that include them (csrc/unit_*.cpp): the torch
# headers dominate the compile time of each unit.
SOURCES = [CSRC / f for f in (
    "attention.cpp", "ops.cpp", "gguf_gemv.cpp", "fixed_gemm.cpp", "quant_gemm.cpp", "decode_stack.cpp",
    "bindings.cpp")]
UNITS = [CSRC / "unit_kernels.cpp", CSRC / "unit_matmul.cpp"]
HEADERS = [CSRC / f for f in ("common.h", "ops.h", "gguf_layouts.h", "fixed_tile.h", "amx.h")]


def extension_name(arch: str) -> str:
    h = hashlib.sha256(f"{arch}|{cpu_info().flags_text}".encode())
    for f in SOURCES + UNITS + HEADERS:
        h.update(f.read_bytes())
    return f"pagedserve_cpu_{h.hexdigest()[:10]}"


@functools.cache
def load_extension(arch: str = "native") -> ModuleType | None:
    """The compiled extension module for `arch` (a -march name), or None where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name=extension_name(arch),
            sources=[str(s) for s in UNITS],
            extra_include_paths=[str(CSRC)],
            # -ffast-math lets the softmax's expf (and the SiLU / GeGLU loops' where no explicit vector form is
            # built: common.h's silu_mul8 / silu_mul16) use glibc's vector version (libmvec): the scalar exp
            # dominated the kernels. No kernel sees inf/NaN inputs by construction.
            extra_cflags=["-O3", f"-march={arch}", "-fopenmp", "-ffast-math", "-std=c++20"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: stay on the portable path
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch paths", e)
        return None
