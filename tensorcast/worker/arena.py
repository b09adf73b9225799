"""First-fit allocator over a fixed arena of bytes. Pure bookkeeping: no memory is touched.

Offsets are aligned to pages so a caller can map any region on its own.
"""

from __future__ import annotations

import bisect

from tensorcast.errors import ResourceExhausted
from tensorcast.types import align_up

PAGE_BYTES = 4096


class ArenaAllocator:
    def __init__(self, capacity_bytes: int, alignment: int = PAGE_BYTES) -> None:
        assert capacity_bytes % alignment == 0
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)] if capacity_bytes else []
        self._used: dict[int, int] = {}
        self.used_bytes = 0

    def allocate(self, size_bytes: int) -> int:
        """Offset of a new region of at least `size_bytes` (empty regions take one page)."""
        size = align_up(max(size_bytes, 1), self.alignment)
        for i, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free_size - size)
                self._used[offset] = size
                self.used_bytes += size
                return offset
        raise ResourceExhausted(
            f"pool full: need {size} bytes, {self.capacity_bytes - self.used_bytes} free of "
            f"{self.capacity_bytes} (largest free block {self.largest_free_bytes()}); "
            "delete artifacts or start the worker with a larger --mem"
        )

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.used_bytes -= size
        i = bisect.bisect(self._free, (offset, size))
        # Coalesce with the neighbours so fragmentation does not accumulate.
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def largest_free_bytes(self) -> int:
        return max((s for _, s in self._free), default=0)

    def free_blocks(self) -> list[tuple[int, int]]:
        return list(self._free)
