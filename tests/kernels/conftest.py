"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from pagedserve.kernels import CpuKernels


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    """The native build's kernels, as the engine gets them (a test module may override this fixture)."""
    k = CpuKernels.build()
    assert k is not None, "the C++ kernels must build wherever a compiler is (as in CI)"
    return k
