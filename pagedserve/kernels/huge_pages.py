"""CPU tensors in memory the OS may back with 2 MB pages (Linux transparent huge pages).

The C++ kernels stream the packed weights (every decode step reads all of them) and the paged KV cache (a
decode step's attention reads each sequence's blocks wherever they lie) through 4 KB pages by default: one
TLB entry per 4 KB, so a step that reads ~100 MB of weights walks ~25,000 page tables. With THP in its
default `madvise` mode the kernel backs a 2 MB-aligned range with 2 MB pages where the process asks for it
(MADV_HUGEPAGE): `zeros` maps such a range (anonymous memory, 2 MB-aligned) and asks. Measured on a Sapphire
Rapids (2 threads): the 121 matmuls of a SmolLM2 Q4_1 decode step, cold, 6.84 -> 5.71 ms.

Where the OS cannot (not Linux, THP `never`, no free 2 MB pages) the memory is the same memory with 4 KB
pages: only the speed differs. Tensors under 2 MB stay ordinary torch allocations. A range is advised only where
the kernel has at least twice its 2 MB pages free already (/proc/buddyinfo): on a fragmented machine the kernel
would compact memory inside the page faults first (THP's default `defrag` for advised ranges), and an engine
start once took 73 s instead of 3 that way, right after the test suite had filled the page cache.
"""

from __future__ import annotations

import mmap

import torch

PAGE = 2 << 20  # bytes of a huge page (x86-64)


def supported() -> bool:
    """Whether this Python can ask for huge pages at all (Linux: mmap.MADV_HUGEPAGE)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def free_pages() -> int | None:
    """2 MB pages the kernel has free now: /proc/buddyinfo's free blocks of order 9 and up (4 KB base pages), in 2 MB
    units; None where it cannot be read."""
    try:
        with open("/proc/buddyinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:  # "Node 0, zone   Normal   <free blocks of order 0> <order 1> ..."
        counts = line.split()[4:]
        total += sum(int(n) << (order - 9) for order, n in enumerate(counts) if order >= 9)
    return total


def enough_free(length: int) -> bool:
    """Whether a range of `length` bytes may be advised: the kernel has twice its 2 MB pages free (or cannot say)."""
    free = free_pages()
    return free is None or -(-length // PAGE) * 2 <= free


def _advise(mapping: mmap.mmap, start: int, length: int) -> None:
    """MADV_HUGEPAGE on mapping[start:start + length] where enough_free (see the module's doc)."""
    if enough_free(length):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, start, length)
        except OSError:  # a kernel without THP: plain pages
            pass


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, touch: bool = True) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor; from 2 MB up, its data starts on a 2 MB boundary of an anonymous mapping
    advised MADV_HUGEPAGE (zero until written) and, with touch, is written once here (its pages are taken now,
    not in the first steps). The tensor keeps the mapping alive."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < PAGE or not supported():
        return torch.zeros(shape, dtype=dtype)
    size = nbytes + PAGE  # room to start on a 2 MB boundary
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping`
    start = -raw.data_ptr() % PAGE
    length = (nbytes + PAGE - 1) // PAGE * PAGE
    _advise(mapping, start, min(length, size - start))
    out = raw[start:start + nbytes].view(dtype).view(shape)
    if touch:
        out.zero_()
    return out


class Arena:
    """Copies of tensors that live as long as a model (its packed weights), side by side in chunks of `zeros`
    memory: most of a model's matmuls are under 2 MB each (SmolLM2-135M's are 0.3-1 MB), so each its own
    mapping would gain nothing. Bump allocation, 64-byte aligned; a tensor of `chunk` bytes or more gets a
    mapping of its own. A chunk's memory goes back when every tensor in it is gone."""

    ALIGN = 64

    def __init__(self, chunk: int = 32 << 20) -> None:
        self.chunk = chunk
        self._buf: torch.Tensor | None = None  # uint8, the current chunk
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """t's values in the arena (t itself where it is not a plain CPU tensor or huge pages are not supported)."""
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or not supported():
            return t
        nbytes = t.numel() * t.element_size()
        if nbytes >= self.chunk:
            out = zeros(t.shape, t.dtype)
        else:
            start = -(-self._used // self.ALIGN) * self.ALIGN
            if self._buf is None or start + nbytes > self.chunk:
                self._buf, start = zeros((self.chunk,), torch.uint8, touch=False), 0  # taken as copies land
            self._used = start + nbytes
            out = self._buf[start:start + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out
