"""Memory for the weights the kernels stream: anonymous pages the kernel is asked to back with transparent huge pages.

A decode step reads every packed weight once, front to back, so its speed is the memory's streaming rate, and at
4 KB pages that rate pays a TLB miss (on a VM, a two-level page walk) every 64 cache lines. glibc's malloc serves
the packed weights from its heap (toolkit.engine.backends.keep_freed_memory keeps blocks of up to 256 MB there),
which `transparent_hugepage=madvise` (the common default) never backs with huge pages. Measured on AMD EPYC (avx2
avx512f), 2 threads, a 512 MB AVX-512 sum: 28.0-28.6 GB/s on 4 KB pages, 35.2-36.5 GB/s on 2 MB pages.

`huge_empty` maps the bytes itself (aligned to the huge page size), advises MADV_HUGEPAGE and hands the mapping to
torch; where that cannot be done (no THP, `never`, not Linux, a small buffer) it is torch.empty. The pages are
whatever the kernel gives: the bits of every result are the same either way, only the speed differs.
"""

from __future__ import annotations

import mmap
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

THP = Path("/sys/kernel/mm/transparent_hugepage")


@lru_cache(maxsize=1)
def huge_page_bytes() -> int:
    """The transparent huge page size where the kernel may use them for an madvise'd mapping, else 0."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    try:
        if "[never]" in (THP / "enabled").read_text():
            return 0
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0


def huge_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor of `numel` elements, on huge pages where the kernel gives them (see above)."""
    size = huge_page_bytes()
    nbytes = numel * dtype.itemsize
    if size == 0 or nbytes < size:
        return torch.empty(numel, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes + size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(numel, dtype=dtype)
    raw = np.frombuffer(buf, dtype=np.uint8)  # holds the mapping for as long as a tensor views it
    start = -raw.ctypes.data % size  # the first huge page boundary (a multiple of the base page: madvise takes it)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:
        pass  # advice refused: base pages, the same bytes
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype)
