"""Builds (once, cached by torch under ~/.cache/torch_extensions) the C++ paged decode-attention kernel.

If there is no compiler, or PAGEDSERVE_NO_EXTENSION=1, `load()` returns None and the batched backend
keeps its pure-PyTorch gather path.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def load():
    if os.environ.get("PAGEDSERVE_NO_EXTENSION") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        return build(
            name="pagedserve_paged_attention_cpu",
            sources=[str(_SRC)],
            # -ffast-math lets the softmax's expf use glibc's vector version (libmvec): the scalar
            # exp was most of the kernel's time. The kernel has no inf/NaN inputs by construction.
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: stay on the portable path
        logger.warning("C++ paged attention kernel unavailable (%s); using the PyTorch gather path", e)
        return None
