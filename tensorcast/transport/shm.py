"""Mapping a worker's pool (a memfd) whole: once in the worker, once in each same-host caller.

Both map it populated (a first touch inside a copy would halve the copy's rate) and ask for
huge pages: where the host allows transparent huge pages for shared memory
(/sys/kernel/mm/transparent_hugepage/shmem_enabled = advise, within_size or always), 2 MiB
pages back the pool and its mappings, and a copy into a region the CPU has not touched lately
costs a quarter less (fewer TLB misses; architecture.md decision 38). Elsewhere the advice is
a no-op and 4 KiB pages are used as before.
"""

from __future__ import annotations

import mmap
from pathlib import Path

# Linux 5.14+; not in Python 3.11's mmap module.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def map_pool(fd: int, size_bytes: int) -> mmap.mmap:
    """Map all of the pool `fd` shared and writable, every page faulted in."""
    mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError:  # a kernel without MADV_POPULATE_WRITE: populate by mapping again
        mm.close()
        mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return mm


def shmem_huge_pages() -> str:
    """The host's transparent huge page policy for shared memory ("never", "advise", ...)."""
    try:
        text = SHMEM_THP.read_text()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"
